"""`optimizer.plan_step`, the cost model, in plain Python: its bytes against a count made here from torch.chunk (DTensor's
Shard split) and its owners, its FLOPs against the products counted by hand, expert banks kept in place, and the
roofline times. Its bytes against a real step's traffic: the plan_step_bytes gloo cases in distributed_cases.py."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from kernel_under_test import optimizer, submodule

assignment = submodule(optimizer, "distributed.assignment")
routing = submodule(optimizer, "routing")
GPT2_SMALL = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12


def _rows_held(rows: int, world: int) -> list[int]:
    """Rows per rank under Shard(0): torch.chunk's split, missing trailing chunks empty."""
    sizes = [len(chunk) for chunk in torch.arange(rows).chunk(world)]
    return sizes + [0] * (world - len(sizes))


def _hand_flops(shape: tuple[int, int], steps: int) -> int:
    m, n = sorted(shape)
    return steps * (2 * m * m * n + 2 * m ** 3 + 2 * m * m * n)  # X Xᵀ, A², (bA + cA²) X


@pytest.mark.parametrize("world", [2, 8, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bytes_are_every_shard_to_its_owner_and_back(world: int, dtype: torch.dtype) -> None:
    plan = optimizer.plan_step(GPT2_SMALL, world, comm_dtype=dtype)
    costs = [assignment.iteration_flops(routing.matrix_view(torch.Size(shape)), 5, "auto", torch.bfloat16)
             for shape in GPT2_SMALL]
    owners = assignment.assign_owners(costs, world)
    itemsize = torch.empty((), dtype=dtype).element_size()
    sent, received = [0] * world, [0] * world
    for (rows, cols), owner in zip(GPT2_SMALL, owners):
        for rank, held in enumerate(_rows_held(rows, world)):
            if rank != owner:  # its rows go to the owner, and come back orthogonalized
                moved = held * cols * itemsize
                sent[rank] += moved
                received[owner] += moved
                sent[owner] += moved
                received[rank] += moved
    assert plan.bytes_sent_per_rank == sent and plan.bytes_received_per_rank == received
    assert plan.bytes_per_rank == sent


def test_flops_are_the_products_of_the_iteration_each_owner_runs() -> None:
    plan = optimizer.plan_step(GPT2_SMALL, 8, ns_steps=5)  # bfloat16: "auto" keeps the standard iteration
    assert sum(plan.flops_per_rank) == sum(_hand_flops(shape, 5) for shape in GPT2_SMALL)
    # float32 on a 768x3072 matrix: "auto" runs the Gram iteration, X Xᵀ and Q X once (4 m² n) and 4 * 5 - 3
    # products of m x m (2 m³ each), fewer than the standard iteration's.
    m, n = 768, 3072
    gram = optimizer.plan_step([(m, n)], 1, ns_dtype=torch.float32).flops_per_rank
    assert gram == [4 * m * m * n + 17 * 2 * m ** 3] and gram[0] < _hand_flops((m, n), 5)
    assert optimizer.plan_step([(m, n)], 1, ns_dtype=torch.float32, ns_algorithm="standard").flops_per_rank == \
        [_hand_flops((m, n), 5)]
    assert plan.balance == max(plan.flops_per_rank) / (sum(plan.flops_per_rank) / 8)
    assert plan.chunks == len(GPT2_SMALL) // (2 * 8) and plan.collectives == 2 * plan.chunks


def test_an_expert_bank_sharded_on_its_experts_stays_in_place() -> None:
    # 8 experts of (64, 32) over 4 ranks: two each, orthogonalized where they are: no bytes.
    plan = optimizer.plan_step([(8, 64, 32)], 4)
    assert plan.bytes_sent_per_rank == [0] * 4 and plan.collectives == 0
    assert plan.flops_per_rank == [2 * _hand_flops((64, 32), 5)] * 4


def test_times_follow_the_roofline_of_the_slowest_rank() -> None:
    device = optimizer.DeviceModel(matmul_flops=1e12, link_bytes_per_s=1e9, collective_latency_s=0.0)
    plan = optimizer.plan_step([(1024, 1024)], 2, comm_dtype=torch.float32, device=device)
    # Rank 0 owns it: it receives rank 1's 512 rows and sends them back; one chunk, so nothing overlaps.
    half = 512 * 1024 * 4
    assert plan.bytes_sent_per_rank == [half, half]
    compute = _hand_flops((1024, 1024), 5) / 1e12
    assert plan.time_serial_s == pytest.approx(compute + 2 * half / 1e9)
    assert plan.time_overlapped_s == pytest.approx(plan.time_serial_s)
    # Two chunks of one matrix each: the first's scatter and the second's gather run under the other's products.
    two = optimizer.plan_step([(1024, 1024)] * 2, 2, comm_dtype=torch.float32, chunk_size=1, device=device)
    assert two.chunks == 2 and two.time_serial_s == pytest.approx(compute + 4 * half / 1e9)
    assert two.time_overlapped_s == pytest.approx(2 * half / 1e9 + max(compute, 2 * half / 1e9))
    assert optimizer.plan_step([(1024, 1024)], 2).time_serial_s is None  # no device, no times


def test_a_mesh_that_does_not_hold_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match="mesh_shape"):
        optimizer.plan_step(GPT2_SMALL, 8, mesh_shape=(2, 2), placements=(Shard(0), Shard(1)))
