"""Which rank orthogonalizes which matrix, and in which chunks: balanced Newton-Schulz work, decided identically on
every rank (and by `plan_step`, which predicts a step from the same decisions)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from ..newton_schulz import gram_flop, resolve_algorithm, standard_flop
from ..routing import MatrixView
from .layout import ShardLayout

# Each rank owns about this many matrices per chunk: enough for the owner to batch same-shape matrices, few enough
# that a step has several chunks whose communication and compute overlap.
MATRICES_PER_RANK_PER_CHUNK = 2


def iteration_flops(view: MatrixView, steps: int, algorithm: str, dtype: torch.dtype) -> float:
    """FLOPs of the Newton-Schulz iteration `zeropower` runs on the view's matrices: the one `algorithm` resolves to
    for the matrix's wide orientation in `dtype` (standard or Gram, `newton_schulz.resolve_algorithm`), full
    products counted. The owners balance this, the work each owner will do."""
    short, long = sorted((view.rows, view.cols))
    flop = gram_flop if resolve_algorithm(algorithm, (short, long), steps, dtype) == "gram" else standard_flop
    return view.batch * flop(short, long, steps)


def assign_owners(costs: Sequence[float], world: int) -> list[int]:
    """Owner rank per item: largest cost first, each to the least-loaded rank (the lowest rank on ties).

    Greedy longest-processing-time scheduling: its makespan is within 4/3 of the optimum, and much closer when
    there are many items per rank, as there are for a transformer's matrices.
    """
    if world < 1:
        raise ValueError(f"Invalid world: {world!r} (expected at least one rank)")
    loads = [(0, rank) for rank in range(world)]
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):  # stable: equal costs keep their order
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + costs[index], rank))
    return owners


def by_decreasing_cost(costs: Sequence[float]) -> list[int]:
    """Item indices, largest cost first (stable), the order chunks are cut in: each chunk then spreads its work
    over the ranks the way `assign_owners` spread the whole step's."""
    return sorted(range(len(costs)), key=lambda i: -costs[i])


def holds_whole_matrices(view: MatrixView, layout: ShardLayout) -> bool:
    """Whether the parameter is split, but only between whole matrices (an expert bank sharded on its expert
    dim): then each rank can orthogonalize its own matrices, exactly as one device would, without transfers."""
    batch_dims = view.batch_dims(len(layout.shape))
    return layout.is_sharded and all(dim in batch_dims for dim in layout.split_dims)


def chunked_owners(costs: Sequence[float], world: int, chunk_size: int | None) -> tuple[list[int], list[list[int]]]:
    """The owner rank of each item and the chunks the pipeline runs them in (item indices, largest cost first;
    `chunk_size` items each, None: MATRICES_PER_RANK_PER_CHUNK per rank)."""
    ordered = by_decreasing_cost(costs)
    size = chunk_size or MATRICES_PER_RANK_PER_CHUNK * world
    return assign_owners(costs, world), [ordered[start:start + size] for start in range(0, len(ordered), size)]
