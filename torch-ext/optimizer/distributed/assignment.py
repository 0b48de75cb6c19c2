"""Which ranks orthogonalize which matrices, and in which chunks: balanced Newton-Schulz work, decided identically on
every rank (and by `plan_step`, which predicts a step from the same decisions).

A matrix goes whole to one owner while that balances the ranks within `BALANCE_GOAL`; when a few large matrices (or
few matrices for many ranks) would not, the divisible ones are laid end to end over the ranks and divided where they
cross from one rank to the next (`_balanced_shares`): an expert bank by its experts (independent matrices, no extra
traffic), a matrix by the columns of its wide orientation (its owners then add up their parts of the Gram matrix
X Xᵀ at every Newton-Schulz step, see `split_newton_schulz`).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from ..newton_schulz import gram_flop, resolve_algorithm, standard_flop
from ..routing import MatrixView
from .layout import Box, ShardLayout, box_numel

# Each rank owns about this many matrices per chunk: enough for the owner to batch same-shape matrices, few enough
# that a step has several chunks whose communication and compute overlap.
MATRICES_PER_RANK_PER_CHUNK = 2
# The largest max/mean Newton-Schulz FLOPs over the ranks that whole matrices may leave before some are divided.
BALANCE_GOAL = 1.05
# Mesh device types on which no matrix is divided by columns. A divided matrix's owners exchange their parts of X Xᵀ at
# every Newton-Schulz step, a collective each time that every owner waits for. Under gloo (CPU meshes) a collective
# cost ~4 ms, and dividing made the step slower both times it was measured (4 ranks on a 2-core Xeon with AMX, bf16:
# 8 GPT-2 matrices whose whole-matrix plan was 1.09 max/mean, 447 ms divided against 275 ms whole; 4 matrices at
# 1.29, 239 against 149 ms). Expert banks divide everywhere (by experts: no extra traffic). On GPUs (NCCL) dividing
# is predicted to pay (`plan_step`), not yet measured.
NO_COLUMN_DIVISION_ON: frozenset[str] = frozenset({"cpu"})
# The narrowest column share. Its products are (m, m) by (m, width), which run far below a GPU's peak when width is
# tiny, and every share adds an (m, m) part of X Xᵀ to each step's exchange.
MIN_SHARE_COLUMNS = 32

# Plans tried with the room per rank recounted from the last plan's divisions.
_FILL_ROUNDS = 4
# Room beyond the mean per rank: shares are whole columns or experts, and never narrower than the minimum, so ranks
# fill a little short of their room; without slack the shortfall would pile up on the last rank.
_FILL_SLACK = 0.01

COLUMNS, EXPERTS = "columns", "experts"


def iteration_flops(view: MatrixView, steps: int, algorithm: str, dtype: torch.dtype, device_type: str) -> float:
    """FLOPs of the Newton-Schulz iteration `zeropower` runs on the view's matrices: the one `algorithm` resolves to
    for the matrix's wide orientation in `dtype` on a `device_type` mesh (standard or Gram,
    `newton_schulz.resolve_algorithm`), full products counted. The owners balance this, the work each owner will do."""
    short, long = sorted((view.rows, view.cols))
    if resolve_algorithm(algorithm, (short, long), steps, dtype, device_type) == "gram":
        return view.batch * gram_flop(short, long, steps, dtype)
    return view.batch * standard_flop(short, long, steps)


def column_share_flops(short: int, width: int, steps: int) -> float:
    """FLOPs of one share of `width` columns of a wide (short, n) matrix in the divided standard iteration: per step
    its part of X Xᵀ, then Y = A X_j and A Y (the polynomial applied without forming A², which would cost every
    owner the whole m³)."""
    return steps * 6.0 * short * short * width


@dataclass(frozen=True)
class Splitting:
    """How an item may be divided: along storage dim `dim` (`length` long), into shares of at least `min_width`
    indices costing `unit_flops` per index; `kind` EXPERTS (whole matrices) or COLUMNS (one matrix's long dim)."""

    kind: str
    dim: int
    length: int
    unit_flops: float
    min_width: int


@dataclass(frozen=True)
class Work:
    """One item's Newton-Schulz FLOPs whole, and how it may be divided (None: it may not)."""

    flops: float
    splitting: Splitting | None = None


@dataclass(frozen=True)
class Share:
    """The part of an item one rank orthogonalizes: storage indices [start, stop) along `dim` of kind `kind`, or
    the whole item (`kind` None)."""

    owner: int
    kind: str | None = None
    dim: int = 0
    start: int = 0
    stop: int = 0

    def box(self, shape: Sequence[int]) -> Box:
        """The share's box of the item's (storage-order) tensor."""
        full = [slice(0, size) for size in shape]
        if self.kind is not None:
            full[self.dim] = slice(self.start, self.stop)
        return tuple(full)


def work_of(view: MatrixView, layout: ShardLayout, steps: int, algorithm: str, dtype: torch.dtype,
            device_type: str) -> Work:
    """An item's work and how it may be divided: a bank of several experts along its one batch dim; a single
    matrix along the long dim of its wide orientation, on a mesh of `device_type` not in NO_COLUMN_DIVISION_ON,
    into shares that run the divided standard iteration (the Gram iteration's (m, m) products cannot be divided that
    way): where it runs the standard iteration whole, and where "auto" takes Gram in 16-bit on a GPU, for speed
    alone (whole, it runs Gram; divided, the standard iteration, as near the polar factor in 16-bit), but not where
    Gram was asked for, nor in float32 and float64, where a matrix stays whole to run what one device would. Only
    along dims whose storage order is the global order, and of matrices stored as they are (not "transposed")."""
    flops = iteration_flops(view, steps, algorithm, dtype, device_type)
    ndim = len(layout.shape)
    in_order = [dim for dim in range(ndim) if not layout.orders or layout.orders[dim] is None]
    batch_dims = view.batch_dims(ndim)
    if view.spatial_batched:
        return Work(flops)
    if view.batch > 1:
        if len(batch_dims) == 1 and batch_dims[0] in in_order:
            return Work(flops, Splitting(EXPERTS, batch_dims[0], view.batch, flops / view.batch, 1))
        return Work(flops)
    short, long = sorted((view.rows, view.cols))
    long_dim = view.row_dim if view.rows > view.cols else (view.column_dims[0] if len(view.column_dims) == 1 else None)
    gram = resolve_algorithm(algorithm, (short, long), steps, dtype, device_type) == "gram"
    if (device_type in NO_COLUMN_DIVISION_ON or ndim != 2 or view.transposed or long_dim not in in_order
            or long < 2 * MIN_SHARE_COLUMNS or algorithm == "gram" or (gram and dtype.itemsize > 2)):
        return Work(flops)
    return Work(flops, Splitting(COLUMNS, long_dim, long, column_share_flops(short, 1, steps), MIN_SHARE_COLUMNS))


def holds_whole_matrices(view: MatrixView, layout: ShardLayout) -> bool:
    """Whether the parameter is split, but only between whole matrices (an expert bank sharded on its expert
    dim): then each rank can orthogonalize its own matrices, exactly as one device would, without transfers."""
    batch_dims = view.batch_dims(len(layout.shape))
    return layout.is_sharded and all(dim in batch_dims for dim in layout.split_dims)


def in_place_loads(banks: Iterable[tuple[MatrixView, ShardLayout]], world: int, steps: int, algorithm: str,
                   dtype: torch.dtype, device_type: str) -> list[float]:
    """Per rank, the Newton-Schulz FLOPs of the whole matrices it holds of the banks updated in place."""
    loads = [0.0] * world
    for view, layout in banks:
        for rank, box in enumerate(layout.boxes):
            loads[rank] += iteration_flops(replace(view, batch=box_numel(box) // (view.rows * view.cols)), steps,
                                           algorithm, dtype, device_type)
    return loads


@dataclass(frozen=True)
class SpreadPlan:
    """Who orthogonalizes what in one distributed step: `in_place[j]`, whether item j (a bank whose ranks hold whole
    experts) is updated where it lies; the others (`spread`, item indices) go through the all-to-all pipeline with
    their `works`, `shares` and `chunks` (indices into `spread`); `base` is each rank's FLOPs of the banks in place."""

    in_place: tuple[bool, ...]
    spread: tuple[int, ...]
    works: tuple[Work, ...]
    shares: tuple[tuple[Share, ...], ...]
    chunks: tuple[tuple[int, ...], ...]
    base: tuple[float, ...]


@lru_cache(maxsize=64)  # every step asks again: at hundreds of ranks planning takes longer than the products
def plan_spread(views: tuple[MatrixView, ...], layouts: tuple[ShardLayout, ...], world: int, steps: int,
                algorithm: str, dtype: torch.dtype, device_type: str, chunk_size: int | None,
                keep_banks: bool = True) -> SpreadPlan:
    """The step's plan for items of `views` laid out by `layouts` over `world` ranks (the same on every rank, and
    in `plan_step`). Banks whose ranks hold whole experts stay in place (with `keep_banks`: no transfer), unless
    their holders then carry more than the mean work, which no placement of the rest can balance (256 experts over
    512 ranks leave half the ranks without any): banks are then released into the pipeline, the one weighing most
    on the busiest rank first, until no rank's banks exceed the mean, and the released plan is kept if it balances
    better (whole experts may be too coarse to)."""
    iteration = (steps, algorithm, dtype, device_type)
    held = [j for j, (view, layout) in enumerate(zip(views, layouts))
            if keep_banks and holds_whole_matrices(view, layout)]
    loads = {j: in_place_loads([(views[j], layouts[j])], world, *iteration) for j in held}
    works = [work_of(view, layout, *iteration) for view, layout in zip(views, layouts)]
    mean = (sum(sum(load) for load in loads.values())
            + sum(works[j].flops for j in range(len(views)) if j not in loads)) / world
    kept = _planned(works, loads, list(held), world, chunk_size)
    remaining, base = list(held), _base(loads, held, world)
    while remaining and max(base) > mean:
        busiest = max(range(world), key=base.__getitem__)
        bank = max(remaining, key=lambda j: (loads[j][busiest], -j))
        remaining.remove(bank)
        base = [load - released for load, released in zip(base, loads[bank])]
    if len(remaining) == len(held):
        return kept
    released = _planned(works, loads, remaining, world, chunk_size)
    return released if _plan_balance(released) < _plan_balance(kept) else kept


def _base(loads: dict[int, list[float]], banks: Sequence[int], world: int) -> list[float]:
    return [sum(loads[j][rank] for j in banks) for rank in range(world)]


def _planned(works: Sequence[Work], loads: dict[int, list[float]], banks_in_place: Sequence[int], world: int,
             chunk_size: int | None) -> SpreadPlan:
    in_place = frozenset(banks_in_place)
    base = tuple(_base(loads, banks_in_place, world))
    spread = tuple(j for j in range(len(works)) if j not in in_place)
    spread_works = tuple(works[j] for j in spread)
    shares, chunks = chunked_shares(spread_works, world, chunk_size, base)
    return SpreadPlan(tuple(j in in_place for j in range(len(works))), spread, spread_works, tuple(shares),
                      tuple(tuple(chunk) for chunk in chunks), base)


def _plan_balance(plan: SpreadPlan) -> float:
    return _balance(plan.works, plan.shares, len(plan.base), plan.base)


def chunked_shares(works: Sequence[Work], world: int, chunk_size: int | None,
                   base_loads: Sequence[float] | None = None) -> tuple[list[tuple[Share, ...]], list[list[int]]]:
    """The shares of each item and the chunks the pipeline runs the items in (item indices, largest work first;
    `chunk_size` items each, None: MATRICES_PER_RANK_PER_CHUNK per rank). `base_loads`: FLOPs each rank has
    already (its expert banks updated in place)."""
    if world < 1:
        raise ValueError(f"Invalid world: {world!r} (expected at least one rank)")
    base = tuple(base_loads) if base_loads is not None else (0.0,) * world
    shares = _balanced_shares(tuple(works), world, base)
    ordered = sorted(range(len(works)), key=lambda i: -works[i].flops)
    size = chunk_size or MATRICES_PER_RANK_PER_CHUNK * world
    return list(shares), [ordered[start:start + size] for start in range(0, len(ordered), size)]


def share_flops(work: Work, share: Share) -> float:
    return work.flops if share.kind is None else work.splitting.unit_flops * (share.stop - share.start)


def rank_flops(works: Sequence[Work], shares: Sequence[tuple[Share, ...]], world: int,
               base_loads: Sequence[float] | None = None) -> list[float]:
    """Newton-Schulz FLOPs per rank: its base load and its shares."""
    loads = list(base_loads) if base_loads is not None else [0.0] * world
    for work, item_shares in zip(works, shares):
        for share in item_shares:
            loads[share.owner] += share_flops(work, share)
    return loads


@lru_cache(maxsize=64)  # every step of a run asks again with the same work
def _balanced_shares(works: tuple[Work, ...], world: int, base: tuple[float, ...]) -> tuple[tuple[Share, ...], ...]:
    """Whole items by LPT when that balances the ranks; else the items that cannot be divided by LPT, and the others
    laid end to end over the ranks' remaining room (McNaughton's wrap-around rule), an item divided where it
    crosses from one rank to the next: at most one division per rank, so few shares and little extra traffic."""
    whole = _scheduled(works, range(len(works)), world, list(base))
    if _balance(works, whole, world, base) <= BALANCE_GOAL:
        return whole
    fixed = [index for index, work in enumerate(works) if work.splitting is None]
    placed = _scheduled(works, fixed, world, list(base))
    divisible = sorted((index for index, work in enumerate(works) if work.splitting is not None),
                       key=lambda index: -works[index].flops)
    # The room each rank is filled to: the mean load, counted first with whole items, then (a divided matrix costs
    # more than a whole one, see `column_share_flops`) with the last plan's divisions. The plan whose busiest rank
    # carries least: divisions add FLOPs, so the plan nearest the mean may load its busiest rank more (Llama-3-70B's
    # MLP matrices, whole in float16 Gram or divided into standard shares at 1.9x its FLOPs, on 512 H100s: 30.8
    # TFLOP whole at 1.57x the mean, 32.6 divided at 1.05x, predicted 58 against 136 ms).
    best, total = whole, sum(rank_flops(works, whole, world, base))
    for _ in range(_FILL_ROUNDS):
        shares = list(placed)
        room = [total / world * (1 + _FILL_SLACK) - load for load in rank_flops(works, placed, world, base)]
        rank = 0
        for index in divisible:
            shares[index], rank = _wrapped(works[index], room, rank)
        if max(rank_flops(works, shares, world, base)) < max(rank_flops(works, best, world, base)):
            best = tuple(shares)
        total = sum(rank_flops(works, shares, world, base))
    return best


def _wrapped(work: Work, room: list[float], rank: int) -> tuple[tuple[Share, ...], int]:
    """The item's shares filling `room` (FLOPs each rank may still take, updated) from `rank` on, and the rank the
    next item starts at. No share is narrower than the splitting's minimum, nor leaves a rest that would be: a rank
    with less room takes less (or nothing), and the last rank takes whatever is left."""
    split = work.splitting
    last = len(room) - 1
    if work.flops <= room[rank] or rank == last:
        room[rank] -= work.flops
        return (Share(rank),), rank
    pieces: list[tuple[int, int, int]] = []  # (owner, start, stop)
    start = 0
    while start < split.length:
        left = split.length - start
        width = left if rank == last else min(left, int(room[rank] // split.unit_flops))
        if 0 < left - width < split.min_width:
            width = left - split.min_width
        if width >= split.min_width or width == left:
            pieces.append((rank, start, start + width))
            room[rank] -= width * split.unit_flops
            start += width
        if start < split.length:
            rank = min(rank + 1, last)
    if len(pieces) == 1:  # it went to one rank after all: whole, at its whole cost
        room[rank] += split.length * split.unit_flops - work.flops
        return (Share(rank),), rank
    return tuple(Share(owner, split.kind, split.dim, lo, hi) for owner, lo, hi in pieces), rank


def _scheduled(works: Sequence[Work], indices: Iterable[int], world: int,
               loads: list[float]) -> tuple[tuple[Share, ...], ...]:
    """The items `indices` whole, by greedy longest-processing-time scheduling onto ranks already carrying `loads`:
    largest first, each to the least-loaded rank (the lowest rank on ties). Its makespan is within the largest item
    of the mean, so many small items balance. Other items get no share."""
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    result: list[tuple[Share, ...]] = [()] * len(works)
    for index in sorted(indices, key=lambda index: -works[index].flops):  # stable: equal work keeps its order
        load, rank = heapq.heappop(heap)
        result[index] = (Share(rank),)
        heapq.heappush(heap, (load + works[index].flops, rank))
    return tuple(result)


def _balance(works: Sequence[Work], shares: Sequence[tuple[Share, ...]], world: int, base: Sequence[float]) -> float:
    loads = rank_flops(works, shares, world, base)
    mean = sum(loads) / world
    return max(loads) / mean if mean else 1.0
