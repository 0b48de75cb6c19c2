"""What one all-to-all moves, seen from one rank: pure bookkeeping over layouts and owners, no communication.

Every rank computes the plan of every exchange from the same shapes and placements, so all ranks agree on the
split sizes and on whether an exchange moves any data at all (when none does, no rank launches it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .layout import Box, ShardLayout, box_numel


@dataclass(frozen=True)
class Piece:
    """A box of item `item` (its index in the chunk) sent to or received from `peer`, at `offset` in the buffer."""

    item: int
    peer: int
    offset: int
    box: Box


@dataclass(frozen=True)
class Exchange:
    """One rank's side of an all-to-all: split sizes per peer rank and the pieces in buffer order."""

    send_counts: list[int]
    recv_counts: list[int]
    sends: list[Piece]
    receives: list[Piece]
    moves_data: bool  # whether any rank sends to another rank: the same on every rank

    @property
    def send_total(self) -> int:
        return sum(self.send_counts)

    @property
    def recv_total(self) -> int:
        return sum(self.recv_counts)


def _pieces(entries: Sequence[tuple[int, int, Box]], world: int) -> tuple[list[int], list[Piece]]:
    """Lays out (item, peer, box) entries, already in peer-then-item order, in one flat buffer."""
    counts = [0] * world
    pieces: list[Piece] = []
    offset = 0
    for item, peer, box in entries:
        numel = box_numel(box)
        pieces.append(Piece(item, peer, offset, box))
        counts[peer] += numel
        offset += numel
    return counts, pieces


def gather_exchange(layouts: Sequence[ShardLayout], owners: Sequence[int], me: int) -> Exchange:
    """Each matrix's boxes travel to its owner, one copy per distinct box; an owner's own box stays put."""
    world = layouts[0].world if layouts else 1
    sources = [layout.sources(owner) for layout, owner in zip(layouts, owners)]
    sends = [(j, peer, layouts[j].boxes[me]) for peer in range(world) if peer != me
             for j in range(len(layouts)) if owners[j] == peer and me in sources[j]]
    receives = [(j, peer, layouts[j].boxes[peer]) for peer in range(world) if peer != me
                for j in range(len(layouts)) if owners[j] == me and peer in sources[j]]
    send_counts, send_pieces = _pieces(sends, world)
    recv_counts, recv_pieces = _pieces(receives, world)
    moves = any(rank != owner for found, owner in zip(sources, owners) for rank in found)
    return Exchange(send_counts, recv_counts, send_pieces, recv_pieces, moves)


def scatter_exchange(layouts: Sequence[ShardLayout], owners: Sequence[int], me: int) -> Exchange:
    """Each owner sends every other rank that rank's box of the orthogonalized matrix."""
    world = layouts[0].world if layouts else 1
    sends = [(j, peer, layouts[j].boxes[peer]) for peer in range(world) if peer != me
             for j in range(len(layouts)) if owners[j] == me and box_numel(layouts[j].boxes[peer])]
    receives = [(j, peer, layouts[j].boxes[me]) for peer in range(world) if peer != me
                for j in range(len(layouts)) if owners[j] == peer and box_numel(layouts[j].boxes[me])]
    send_counts, send_pieces = _pieces(sends, world)
    recv_counts, recv_pieces = _pieces(receives, world)
    moves = any(box_numel(box) for layout, owner in zip(layouts, owners)
                for rank, box in enumerate(layout.boxes) if rank != owner)
    return Exchange(send_counts, recv_counts, send_pieces, recv_pieces, moves)
