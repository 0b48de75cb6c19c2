"""Which part of a parameter's global tensor each rank holds: one box (a slice per dimension) per rank.

Pure Python on shapes and placements: no communication. Ranks are ranks of the process group the pipeline runs on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product

Box = tuple[slice, ...]


def box_numel(box: Box) -> int:
    return math.prod(s.stop - s.start for s in box)


def _bounds(box: Box) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in box)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in box)


@dataclass(frozen=True)
class ShardLayout:
    """`boxes[r]` is the box of the global tensor (shape `shape`) that rank r holds; boxes may repeat (replicas)."""

    shape: tuple[int, ...]
    boxes: tuple[Box, ...]

    @property
    def world(self) -> int:
        return len(self.boxes)

    @property
    def is_sharded(self) -> bool:
        """Whether some rank lacks part of the tensor (then a non-finite gradient may show on some ranks only)."""
        return any(box_numel(box) != math.prod(self.shape) for box in self.boxes)

    def sources(self, owner: int) -> list[int]:
        """One rank per distinct non-empty box, whose copy is sent to `owner`: the owner itself when it holds
        that box (no transfer), else the lowest rank that does."""
        chosen: dict[tuple[tuple[int, int], ...], int] = {}  # slices are unhashable before Python 3.12
        for rank, box in enumerate(self.boxes):
            if box_numel(box):
                chosen.setdefault(_bounds(box), rank)
        if _bounds(self.boxes[owner]) in chosen:
            chosen[_bounds(self.boxes[owner])] = owner
        return sorted(chosen.values())


def replicated_layout(shape: Sequence[int], world: int) -> ShardLayout:
    """A tensor every rank holds whole (DDP)."""
    full = tuple(slice(0, size) for size in shape)
    return ShardLayout(tuple(shape), (full,) * world)


def _chunk(start: int, stop: int, parts: int, index: int) -> slice:
    """Part `index` of [start, stop) split as torch.chunk and DTensor's Shard do: ceil-sized parts, the last ones
    shorter or empty (10 rows over 4 ranks: 3, 3, 3, 1)."""
    length = stop - start
    size = -(-length // parts)
    return slice(start + min(index * size, length), start + min((index + 1) * size, length))


def sharded_layout(shape: Sequence[int], mesh_shape: Sequence[int], shard_dims: Sequence[int | None],
                   group_rank_at: dict[tuple[int, ...], int]) -> ShardLayout:
    """The layout of a DTensor on a device mesh of `mesh_shape`.

    `shard_dims[i]` is the tensor dim mesh dim i shards (Shard(d)), or None (Replicate). Shards on the same tensor
    dim nest in mesh-dim order, as DTensor does. `group_rank_at` maps each mesh coordinate to its group rank.
    """
    boxes: dict[int, Box] = {}
    for coordinate in product(*(range(size) for size in mesh_shape)):
        box = [slice(0, size) for size in shape]
        for mesh_dim, tensor_dim in enumerate(shard_dims):
            if tensor_dim is not None:
                current = box[tensor_dim]
                box[tensor_dim] = _chunk(current.start, current.stop, mesh_shape[mesh_dim], coordinate[mesh_dim])
        boxes[group_rank_at[coordinate]] = tuple(box)
    return ShardLayout(tuple(shape), tuple(boxes[rank] for rank in range(len(boxes))))
