"""One rank of a `torchrun` job on simulated nodes: HSDP (replicas across nodes, FSDP2 shards within a node) trains
the checkpoint cases' model with Muon and saves a DCP checkpoint after every step; a job that finds checkpoints
resumes from the newest, whatever the number of nodes that wrote it. With --fail-at, the last rank dies before that
step, once per job, and torchrun's restart resumes. The last step compares the parameters with one device's
uninterrupted run. Started by test_multinode.py."""

from __future__ import annotations

import argparse
import os
import sys
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


def _init_process_group() -> None:
    """Gloo on torchrun's store under a prefix per attempt: the rendezvous store outlives a restart, and the keys the
    first attempt's ranks left there (their gloo addresses, now dead) would otherwise be read by the next ones."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


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
    _init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    start = _newest(args.checkpoints)
    model = _hsdp(small_mlp(seed=1 if start else 0))  # resumed, another seed: only the checkpoint can make it right
    optimizer = muon_for(model, "")
    if start:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(args.checkpoints / f"step-{start}"))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    died = args.checkpoints / "a-rank-died"  # once per job: a restart may give the last rank to another node
    for step in range(start, args.steps):
        if step == args.fail_at and rank == world - 1 and not died.exists():
            died.touch()
            os._exit(17)  # no goodbye: the rank is simply gone, as a crashed host's would be
        train_steps(model, optimizer, range(step, step + 1), rank, world)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state},
                 checkpoint_id=str(args.checkpoints / f"step-{step + 1}"))
    assert_matches(list(model.parameters()), list(uninterrupted(args.steps, "").parameters()), FP32_ATOL)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
