"""Spawned cases for the parallelisms of real training setups: tensor parallelism (parallelize_module), FSDP2 on top
of it (strided shards), HSDP (replicas of shards) and expert parallelism (expert banks sharded on the expert dim),
each against single-device Muon on the same global gradients, plus which collectives the step launches."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from distributed_cases import (FP32_ATOL, OPTIONS, STEPS, UNEVEN_STRIDED_SHARDS_PLACED, Muon, assert_matches,
                               randn_tensors, run_pair)
from kernel_under_test import optimizer, submodule

comm = submodule(optimizer, "distributed.comm")
step_module = submodule(optimizer, "distributed.step")

# Colwise splits the output features (Shard(0) of an nn.Linear weight), Rowwise the input features (Shard(1)).
BLOCK_PLAN = {"query": ColwiseParallel(), "key": ColwiseParallel(), "value": ColwiseParallel(),
              "out": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}


class Block(nn.Module):
    """A pre-norm-free transformer block: multi-head attention and an MLP, written so that a rank holding a
    subset of the heads (and of the hidden units) computes its part, as tensor parallelism needs."""

    def __init__(self, hidden: int, width: int = 8, head_dim: int = 2) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.query, self.value = nn.Linear(width, width), nn.Linear(width, width)
        # No key bias: it shifts every score of a query equally, so softmax cancels it and its true gradient is 0;
        # AdamW would then turn rounding noise of either run into full-size, unrelated updates.
        self.key = nn.Linear(width, width, bias=False)
        self.out = nn.Linear(width, width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape

        def heads(projection: nn.Linear) -> torch.Tensor:  # (batch, local heads, length, head_dim)
            return projection(x).view(batch, length, -1, self.head_dim).transpose(1, 2)

        attended = F.scaled_dot_product_attention(heads(self.query), heads(self.key), heads(self.value))
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, -1))
        return x + self.down(torch.tanh(self.up(x)))


def _train_against_reference(model: nn.Module, reference: nn.Module, batch_part: Callable[[torch.Tensor], torch.Tensor],
                             record: list | None = None) -> None:
    """STEPS steps of Muon on `model` (its rank's part of each batch) and on `reference` (the whole batch), then
    every parameter compared. FSDP averages gradients over its ranks, so a mean loss gives the same gradients."""
    ours = Muon(model.parameters(), **OPTIONS, comm_dtype=torch.float32)
    truth = Muon(reference.parameters(), **OPTIONS)
    for step in range(STEPS):
        batch = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(500 + step))
        model(batch_part(batch)).square().mean().backward()
        reference(batch).square().mean().backward()
        with recording_collectives(record) if record is not None else contextlib.nullcontext():
            ours.step()
        truth.step()
        ours.zero_grad()
        truth.zero_grad()
    assert_matches(list(model.parameters()), list(reference.parameters()), FP32_ATOL)


@contextlib.contextmanager
def recording_collectives(record: list) -> Iterator[None]:
    """Appends (collective name, global ranks of its group) for every collective the distributed step launches:
    all of them go through torch.distributed's all_to_all_single and all_reduce (comm.py)."""
    originals = {name: getattr(dist, name) for name in ("all_to_all_single", "all_reduce")}

    def recorder(name: str, original: Callable) -> Callable:
        def call(*args, group=None, **kwargs):
            record.append((name, tuple(dist.get_process_group_ranks(group or dist.group.WORLD))))
            return original(*args, group=group, **kwargs)
        return call

    for name, original in originals.items():
        setattr(dist, name, recorder(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def tensor_parallel_case(world: int) -> None:
    """parallelize_module over all ranks; every rank sees the whole batch (TP splits weights, not data)."""
    torch.manual_seed(0)
    # Even splits only: RowwiseParallel rebuilds its input's global shape as world * the local one.
    model = Block(hidden=12)
    reference = copy.deepcopy(model)
    parallelize_module(model, init_device_mesh("cpu", (world,)), BLOCK_PLAN)
    placements = {p.placements for p in model.parameters() if p.ndim == 2}
    assert placements == {(Shard(0),), (Shard(1),)}, placements
    _train_against_reference(model, reference, lambda batch: batch)


def _layout_matches_local_tensors(model: nn.Module) -> None:
    """The layout's boxes pick, from each parameter's global value, exactly the rank's local tensor: checks the
    strided-shard bookkeeping against what FSDP2 and DTensor really placed on this rank."""
    for param in model.parameters():
        mesh = param.device_mesh
        dims = comm.spread_mesh_dims(mesh, param.placements)
        group = comm.spread_group(mesh, dims)
        layout = step_module._layout(param, group, dims, dist.get_world_size(group))
        mine = layout.boxes[dist.get_rank(group)]
        assert torch.equal(layout.to_storage(param.full_tensor())[mine], param.to_local()), param.placements


def fsdp_over_tensor_parallel_case() -> None:
    """A (dp=2, tp=2) mesh: TP inside each dp group, FSDP2 across them; weights end up (_StridedShard(0), Shard(0))
    (column-parallel) and (Shard(0), Shard(1)) (row-parallel). Each dp group gets half the batch."""
    torch.manual_seed(0)
    # up's rows: 5 per tp rank, then 3 and 2 per dp rank (uneven strided shards; even on torch 2.9, which refuses those)
    model = Block(hidden=10 if UNEVEN_STRIDED_SHARDS_PLACED else 8)
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], BLOCK_PLAN)
    fully_shard(model, mesh=mesh["dp"])
    placements = {p.placements for p in model.parameters() if p.ndim == 2}
    assert placements == {(_StridedShard(0, split_factor=2), Shard(0)), (Shard(0), Shard(1))}, placements
    _layout_matches_local_tensors(model)
    dp = mesh.get_local_rank("dp")
    _train_against_reference(model, reference, lambda batch: batch[2 * dp:2 * dp + 2])


def hsdp_case() -> None:
    """fully_shard on a (replicate=2, shard=2) mesh: (Replicate(), Shard(0)) parameters. Every collective of the
    Muon step stays inside the rank's shard group, and the step does move data there (the check is not empty)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 10), nn.Tanh(), nn.Linear(10, 6), nn.Tanh(), nn.Linear(6, 8))
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    record: list = []
    rank = dist.get_rank()
    _train_against_reference(model, reference, lambda batch: batch[rank:rank + 1], record)
    shard_group = tuple(dist.get_process_group_ranks(mesh.get_group("shard")))
    assert {ranks for _, ranks in record} == {shard_group}, (record, shard_group)
    assert any(name == "all_to_all_single" for name, _ in record), record


def two_shard_dims_beside_a_replicate_dim_case() -> None:
    """A (1, 2, 2) mesh with dim names, its two last dims sharding rows beside a replicate dim: the step runs over
    their flattened group. Made by torch's `DeviceMesh._flatten()`, registered with the root mesh, that group made
    torch gather the uneven DTensors of this mesh out of order afterwards (the check below, `full_tensor()`, as a
    user's code would after the step); the step's own results were right either way."""
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("replicate", "rows", "more_rows"))
    placements = (Replicate(), Shard(0), Shard(0))
    shapes = [(10, 6), (7, 9)]  # uneven: 10 rows as 3, 2, 3, 2; 7 as 2, 2, 2, 1
    params = [distribute_tensor(t, mesh, placements, src_data_rank=None) for t in randn_tensors(shapes, seed=0)]
    make_grad = partial(distribute_tensor, device_mesh=mesh, placements=placements, src_data_rank=None)
    _, _, reference = run_pair(params, make_grad, shapes, comm_dtype=torch.float32)
    assert_matches(params, reference, FP32_ATOL)


def expert_bank_case(world: int, placement: Shard, moves_data: bool) -> None:
    """Two expert banks (E, out, in), one with fewer experts than ranks (empty shards on 4 ranks), and a NaN in
    one expert at step 1 (the bank is skipped everywhere, as on one device). Banks sharded on the expert dim are
    orthogonalized where they live: no all-to-all, only the finite-flag all-reduce every sharded matrix shares;
    sharded on another dim, they go through the pipeline."""
    shapes = [(4, 6, 5), (2, 5, 6)]
    mesh = init_device_mesh("cpu", (world,))
    params = [distribute_tensor(t, mesh, [placement]) for t in randn_tensors(shapes, seed=0)]
    # Split locally (src_data_rank=None): every rank made the same global gradient, and the record then holds
    # only the optimizer's own collectives.
    make_grad = partial(distribute_tensor, device_mesh=mesh, placements=[placement], src_data_rank=None)
    record: list = []
    with recording_collectives(record):
        ours, truth, reference = run_pair(params, make_grad, shapes, nan_at=(0, 1, (0, 1, 2)),
                                          comm_dtype=torch.float32)
    assert_matches(params, reference, FP32_ATOL)
    assert [int(ours.state[p]["nonfinite_skips"]) for p in params] == [1, 0]
    assert [int(truth.state[q]["nonfinite_skips"]) for q in reference] == [1, 0]
    all_to_alls = [entry for entry in record if entry[0] == "all_to_all_single"]
    assert bool(all_to_alls) == moves_data, record
    if not moves_data:
        assert record == [("all_reduce", tuple(range(world)))] * STEPS, record


def cases_for(world: int) -> dict[str, Callable[[], None]]:
    cases: dict[str, Callable[[], None]] = {
        "tensor_parallel_colwise_rowwise": partial(tensor_parallel_case, world),
        "experts_sharded_on_expert_dim_stay_local": partial(expert_bank_case, world, Shard(0), False),
        "experts_sharded_on_rows_use_the_pipeline": partial(expert_bank_case, world, Shard(1), True),
    }
    if world == 4:
        cases["fsdp2_over_tensor_parallel_2x2"] = fsdp_over_tensor_parallel_case
        cases["hsdp_replicate_shard_2x2"] = hsdp_case
        cases["two_shard_dims_beside_a_replicate_dim_1x2x2"] = two_shard_dims_beside_a_replicate_dim_case
    return cases
