"""Which part of a parameter's global tensor each rank holds: one box (a slice per dimension) per rank.

No communication: layouts follow from shapes and placements alone. Ranks are ranks of the process group the pipeline
runs on.

A box is contiguous in *storage order*, which is the global order except along dims a strided shard splits
(FSDP2 on top of tensor parallelism gives `_StridedShard`): there a rank holds several separate runs of rows, and the
layout keeps, per dim, the global index at each storage position. Storage order lists each rank's indices as one
run, so boxes stay slices and only the owner, which holds the whole tensor, permutes it to and from global order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from itertools import product

import torch
from torch import Tensor

from ..state_precision import EntryPositions
from .dtensors import Placement, is_dtensor, sharded_tensor_dim

Box = tuple[slice, ...]
Order = tuple[int, ...] | None  # the global index at each storage position of one dim; None: the identity


def box_numel(box: Box) -> int:
    return math.prod(s.stop - s.start for s in box)


def _bounds(box: Box) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in box)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in box)


def intersection(a: Box, b: Box) -> Box | None:
    """The box both hold, or None when they share no element."""
    common = []
    for x, y in zip(a, b):  # a loop that stops at the first disjoint dim: planning calls it per share and rank
        start, stop = max(x.start, y.start), min(x.stop, y.stop)
        if start >= stop:
            return None
        common.append(slice(start, stop))
    return tuple(common)


def within(box: Box, outer: Box) -> Box:
    """`box`, a part of `outer`, in the coordinates of a tensor holding `outer`."""
    return tuple(slice(s.start - o.start, s.stop - o.start) for s, o in zip(box, outer))


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """`boxes[r]` is the box, in storage order, of the global tensor (shape `shape`) that rank r holds; boxes may
    repeat (replicas). `orders[d]` maps storage positions of dim d to global indices (None: the same).

    Compared and hashed by identity (slices are unhashable before Python 3.12): `sharded_layout` and
    `replicated_layout` return the same object for the same placements, so plans cached on layouts are found again at
    every step."""

    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    orders: tuple[Order, ...] = ()

    @property
    def world(self) -> int:
        return len(self.boxes)

    @cached_property  # every step asks, of every parameter: at hundreds of ranks a walk over the boxes adds up
    def is_sharded(self) -> bool:
        """Whether some rank lacks part of the tensor (then a non-finite gradient may show on some ranks only)."""
        return any(box_numel(box) != math.prod(self.shape) for box in self.boxes)

    @cached_property
    def split_dims(self) -> tuple[int, ...]:
        """The tensor dims along which some rank holds less than the whole extent."""
        return tuple(dim for dim, size in enumerate(self.shape)
                     if any(box[dim].stop - box[dim].start != size for box in self.boxes))

    @cached_property
    def holders(self) -> dict[tuple[tuple[int, int], ...], tuple[int, ...]]:
        """The ranks holding each distinct non-empty box, lowest first (keyed by bounds: slices are unhashable
        before Python 3.12). Distinct boxes are disjoint and cover the tensor. Computed once: the plans of every
        share ask again."""
        holders: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for rank, box in enumerate(self.boxes):
            if box_numel(box):
                holders.setdefault(_bounds(box), []).append(rank)
        return {bounds: tuple(ranks) for bounds, ranks in holders.items()}

    @cached_property
    def _starts_and_stops(self) -> Tensor:
        """(world, dims, 2): each rank's box as int64 bounds."""
        return torch.tensor([[(s.start, s.stop) for s in box] for box in self.boxes],
                            dtype=torch.int64).view(self.world, len(self.shape), 2)

    def overlap_numels(self, box: Box) -> Tensor:
        """How many elements of `box` each rank holds (int64, one per rank), all ranks at once."""
        bounds = self._starts_and_stops
        starts = bounds[..., 0].clamp(min=torch.tensor([s.start for s in box], dtype=torch.int64))
        stops = bounds[..., 1].clamp(max=torch.tensor([s.stop for s in box], dtype=torch.int64))
        return (stops - starts).clamp(min=0).prod(dim=1)

    def holders_of(self, rank: int) -> tuple[int, ...]:
        """The ranks holding the box `rank` holds, itself among them; none when its box is empty."""
        return self.holders.get(_bounds(self.boxes[rank]), ())

    def counts_once(self, rank: int) -> bool:
        """Whether `rank`'s part is the one counted when every rank's parts are summed: replicas count once."""
        return self.holders_of(rank)[:1] == (rank,)

    def sources(self, owner: int) -> list[int]:
        """One rank per distinct non-empty box, whose copy is sent to `owner`: the owner itself when it holds
        that box (no transfer), else the lowest rank that does."""
        own = _bounds(self.boxes[owner])
        return sorted(owner if bounds == own else ranks[0] for bounds, ranks in self.holders.items())

    def to_global(self, stored: Tensor) -> Tensor:
        """The whole tensor in storage order -> in global order."""
        for dim, order in enumerate(self.orders):
            if order is not None:  # the inverse permutation: global index -> storage position
                stored = stored.index_select(dim, int_tensor_on(order, stored.device).argsort())
        return stored

    def to_storage(self, whole: Tensor) -> Tensor:
        """The whole tensor in global order -> in storage order, where `whole[box]` is a rank's local tensor."""
        for dim, order in enumerate(self.orders):
            if order is not None:
                whole = whole.index_select(dim, int_tensor_on(order, whole.device))
        return whole


@lru_cache(maxsize=4096)
def int_tensor_on(values: tuple[int, ...], device: torch.device) -> Tensor:
    """`values` as an int64 tensor on `device`, made once: the step asks for the same indices and masks every time,
    and a list copied to a GPU at every step made the host wait for the copy."""
    return torch.tensor(values, dtype=torch.int64, device=device)


@lru_cache(maxsize=4096)
def replicated_layout(shape: tuple[int, ...], world: int) -> ShardLayout:
    """A tensor every rank holds whole (DDP). Cached, as `sharded_layout` is: a new object at every step missed
    every plan cached on layouts, and the step planned anew."""
    full = tuple(slice(0, size) for size in shape)
    return ShardLayout(tuple(shape), (full,) * world)


def _indices_held(dim: int, length: int, splits: Sequence[tuple[Placement, int, int]]) -> Tensor:
    """The global indices along tensor dim `dim` that survive `splits` = (placement, mesh dim size, coordinate),
    applied in mesh-dim order with DTensor's own split (torch.chunk for Shard, interleaved runs for _StridedShard).
    """
    indices = _laid_along(dim, length)
    for placement, parts, coordinate in splits:
        indices = _split(placement, indices, parts)[coordinate]
    return indices.reshape(-1)


def _indices_held_at_each(dim: int, length: int, splits: Sequence[tuple[Placement, int]]
                          ) -> dict[tuple[int, ...], Tensor]:
    """`_indices_held` at every coordinate on the mesh dims of `splits` = (placement, mesh dim size), keyed by those
    coordinates: each split made once for all its parts (one split per coordinate at 512 ranks took seconds)."""
    held = {(): _laid_along(dim, length)}
    for placement, parts in splits:
        held = {key + (coordinate,): part for key, indices in held.items()
                for coordinate, part in enumerate(_split(placement, indices, parts))}
    return {key: indices.reshape(-1) for key, indices in held.items()}


def _laid_along(dim: int, length: int) -> Tensor:
    """0 .. length - 1 laid along `dim`, where the placements split."""
    return torch.arange(length).view((1,) * dim + (length,))


def _split(placement: Placement, indices: Tensor, parts: int) -> list[Tensor]:
    """`indices` split into `parts` as DTensor splits a tensor (some parts empty where there are too few)."""
    return placement._split_tensor(indices, parts, with_padding=False)[0]


@lru_cache(maxsize=4096)
def sharded_layout(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...],
                   group_ranks: tuple[int, ...]) -> ShardLayout:
    """The layout of a DTensor on a device mesh of `mesh_shape` with `placements` (Shard, _StridedShard or
    Replicate per mesh dim). `group_ranks` lists the group rank at each mesh coordinate, in row-major order.

    Shards of one tensor dim nest in mesh-dim order, as DTensor applies them. Cached: every step asks again.
    """
    coordinates = list(product(*(range(size) for size in mesh_shape)))
    boxes: list[list[slice]] = [[] for _ in coordinates]
    orders: list[Order] = []
    for dim, length in enumerate(shape):
        mesh_dims = [m for m, placement in enumerate(placements) if sharded_tensor_dim(placement, len(shape)) == dim]
        # coordinates on those mesh dims -> indices held; in order
        runs = _indices_held_at_each(dim, length, [(placements[m], mesh_shape[m]) for m in mesh_dims])
        starts, position = {}, 0
        for key in sorted(runs):
            starts[key] = position
            position += len(runs[key])
        order = tuple(torch.cat([runs[key] for key in sorted(runs)]).tolist())
        orders.append(None if order == tuple(range(length)) else order)
        for index, coordinate in enumerate(coordinates):
            key = tuple(coordinate[m] for m in mesh_dims)
            boxes[index].append(slice(starts[key], starts[key] + len(runs[key])))
    by_rank = dict(zip(group_ranks, boxes))
    return ShardLayout(tuple(shape), tuple(tuple(by_rank[rank]) for rank in range(len(by_rank))), tuple(orders))


def shard_positions(tensor: Tensor) -> EntryPositions | None:
    """For a DTensor, where each entry of this rank's shard lies in the whole (row-major) tensor: what makes per-entry
    choices, such as stochastic rounding's random bits, the same whichever way the tensor is split. None for a plain
    tensor: its own indices are the whole tensor's."""
    return _entry_positions(*_shard_of(tensor)) if is_dtensor(tensor) else None


@lru_cache(maxsize=4096)
def _entry_positions(shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...],
                     coordinate: tuple[int, ...], device: torch.device) -> EntryPositions:
    """The positions of the shard at mesh `coordinate`, on `device`: each dim's held global indices times its
    row-major stride, summed over the dims before a split and over the dims after it, the split where the two vectors
    are shortest together. Made once: each step asks for every rounded-state parameter."""
    terms = [_held_on(dim, shape, placements, mesh_shape, coordinate, device) * math.prod(shape[dim + 1:])
             for dim in range(len(shape))]
    sizes = [len(term) for term in terms]
    split = min(range(len(shape) + 1), key=lambda at: math.prod(sizes[:at]) + math.prod(sizes[at:]))
    return EntryPositions(_sums_of_one_of_each(terms[:split], device), _sums_of_one_of_each(terms[split:], device))


def _sums_of_one_of_each(terms: Sequence[Tensor], device: torch.device) -> Tensor:
    """Every sum of one entry of each term, in row-major order (the first term's entries vary slowest)."""
    sums = torch.zeros(1, dtype=torch.int64, device=device)
    for term in terms:
        sums = (sums[:, None] + term[None, :]).reshape(-1)
    return sums


def local_indices(tensor: Tensor, dim: int) -> Tensor | None:
    """For a DTensor, the global indices along `dim` of this rank's shard, on its device (int64); None for a plain
    tensor, which holds them all."""
    return _held_on(dim, *_shard_of(tensor)) if is_dtensor(tensor) else None


def _shard_of(tensor: Tensor) -> tuple[tuple[int, ...], tuple[Placement, ...], tuple[int, ...], tuple[int, ...],
                                       torch.device]:
    """What a DTensor's shard follows from, hashable: global shape, placements, mesh shape, this rank's mesh
    coordinate and its device (the key of `_entry_positions` and `_held_on`)."""
    mesh = tensor.device_mesh
    return (tuple(tensor.shape), tuple(tensor.placements), tuple(mesh.shape), tuple(mesh.get_coordinate()),
            tensor.to_local().device)


@lru_cache(maxsize=4096)
def _held_on(dim: int, shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...],
             coordinate: tuple[int, ...], device: torch.device) -> Tensor:
    """`_indices_held` along `dim` by the shard at mesh `coordinate`, on `device`. Made once per layout and device:
    the step asks every time, and copying them to a GPU at every step made the host wait for it."""
    splits = [(placement, mesh_shape[m], coordinate[m]) for m, placement in enumerate(placements)
              if sharded_tensor_dim(placement, len(shape)) == dim]
    return _indices_held(dim, shape[dim], splits).to(device)
