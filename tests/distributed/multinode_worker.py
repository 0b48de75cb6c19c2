"""One rank of a `torchrun` job on simulated nodes: HSDP (replicas across nodes, FSDP2 shards within a node) trains
the checkpoint cases' model with Muon and saves a DCP checkpoint after every step; a job that finds checkpoints
resumes from the newest, whatever the number of nodes that wrote it. With --fail-at, the last rank dies before that
step, once per job, and torchrun's restart resumes. The last step compares the parameters with one device's
uninterrupted run. Started by test_multinode.py."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the cases' helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kernel_under_test

from checkpoint_cases import muon_for, small_mlp, train_steps, uninterrupted  # noqa: E402
from distributed_cases import FP32_ATOL, assert_matches  # noqa: E402


def _hsdp(model):
    """Replicated over the nodes, sharded over each node's ranks, as a multi-node job lays a model out."""
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (dist.get_world_size() // per_node, per_node),
                            mesh_dim_names=("replicate", "shard"))
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


# Longer than the failed node's agent takes to notice and call a new rendezvous round (monitor interval 0.5 s).
BUSY_NODE_S = 5.0


def _fail(rank: int, world: int, died: Path) -> None:
    """The last rank dies, with no goodbye, as a crashed host's would. Meanwhile the other nodes' ranks are busy in
    their own work (a long forward pass) rather than in a collective that would fail at once, so their healthy agents
    restart them for the new round, as torchrun restarts the healthy nodes of a real job."""
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    if rank == world - 1:
        died.touch()
        os._exit(17)
    if rank // per_node != (world - 1) // per_node:
        time.sleep(BUSY_NODE_S)


def _newest(checkpoints: Path) -> int:
    """The last step whose checkpoint is complete (DCP writes its .metadata last), 0 when none is."""
    done = [int(path.parent.name.split("-")[1]) for path in checkpoints.glob("step-*/.metadata")]
    return max(done, default=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--fail-at", type=int, default=None, help="the step before which the last rank dies, once")
    args = parser.parse_args()
    died = args.checkpoints / "a-rank-died"  # once per job: a restart may give the last rank to another node
    fails = args.fail_at is not None and not died.exists()  # read before any rank of this attempt can have died
    dist.init_process_group("gloo")  # on the store of this rendezvous round only: see test_multinode.py
    rank, world = dist.get_rank(), dist.get_world_size()
    start = _newest(args.checkpoints)
    model = _hsdp(small_mlp(seed=1 if start else 0))  # resumed, another seed: only the checkpoint can make it right
    optimizer = muon_for(model, "")
    if start:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(args.checkpoints / f"step-{start}"))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    for step in range(start, args.steps):
        if fails and step == args.fail_at:
            _fail(rank, world, died)
        train_steps(model, optimizer, range(step, step + 1), rank, world)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state},
                 checkpoint_id=str(args.checkpoints / f"step-{step + 1}"))
    assert_matches(list(model.parameters()), list(uninterrupted(args.steps, "").parameters()), FP32_ATOL)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
