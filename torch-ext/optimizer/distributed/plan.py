"""What each all-to-all moves: pure bookkeeping over layouts and shares, no communication.

Every rank computes the plan of every exchange from the same shapes, placements and shares, so all ranks agree on the
split sizes and on whether an exchange moves any data at all (when none does, no rank launches it). `plan_step`
counts the bytes of every rank from the same transfers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from .assignment import Share
from .layout import Box, ShardLayout, box_numel, intersection


@dataclass(frozen=True)
class Transfer:
    """Box `box` (global storage coordinates) of item `item`'s share `share`, from rank `source` to `target`
    (the same rank: it stays where it is)."""

    item: int
    share: int
    source: int
    target: int
    box: Box


@dataclass(frozen=True)
class Piece:
    """A box of item `item`'s share `share` sent to or received from `peer`, at `offset` in the buffer."""

    item: int
    share: int
    peer: int
    offset: int
    box: Box


@dataclass(frozen=True)
class Exchange:
    """One rank's side of an all-to-all: split sizes per peer rank and the pieces in buffer order; `kept`: the
    transfers from this rank to itself, which stay in place."""

    send_counts: list[int]
    recv_counts: list[int]
    sends: list[Piece]
    receives: list[Piece]
    kept: list[Transfer]
    moves_data: bool  # whether any rank sends to another rank: the same on every rank

    @property
    def send_total(self) -> int:
        return sum(self.send_counts)

    @property
    def recv_total(self) -> int:
        return sum(self.recv_counts)


@lru_cache(maxsize=256)  # every step asks again: at hundreds of ranks the plans take longer than the products
def chunk_exchanges(layouts: tuple[ShardLayout, ...], shares: tuple[tuple[Share, ...], ...],
                    me: int) -> tuple[Exchange, Exchange]:
    """`me`'s side of a chunk's gather and scatter."""
    world = layouts[0].world
    return (exchange(gather_transfers(layouts, shares), world, me),
            exchange(scatter_transfers(layouts, shares), world, me))


def gather_transfers(layouts: Sequence[ShardLayout], shares: Sequence[Sequence[Share]]) -> list[Transfer]:
    """Each share's part of every distinct box travels to the share's owner, from the owner itself when it holds
    that box, else from the lowest rank that does."""
    transfers = []
    for item, (layout, item_shares) in enumerate(zip(layouts, shares)):
        for index, share in enumerate(item_shares):
            wanted = share.box(layout.shape)
            for source in layout.sources(share.owner):
                part = intersection(layout.boxes[source], wanted)
                if part is not None:
                    transfers.append(Transfer(item, index, source, share.owner, part))
    return transfers


def scatter_transfers(layouts: Sequence[ShardLayout], shares: Sequence[Sequence[Share]]) -> list[Transfer]:
    """Each share's owner sends every rank the part of the orthogonalized share that rank holds."""
    transfers = []
    for item, (layout, item_shares) in enumerate(zip(layouts, shares)):
        for index, share in enumerate(item_shares):
            made = share.box(layout.shape)
            for target, held in enumerate(layout.boxes):
                part = intersection(made, held)
                if part is not None:
                    transfers.append(Transfer(item, index, share.owner, target, part))
    return transfers


def exchange(transfers: Sequence[Transfer], world: int, me: int) -> Exchange:
    """`me`'s side of the all-to-all that carries `transfers`: sends in peer-then-item order, receives likewise."""
    outgoing = sorted((t for t in transfers if t.source == me and t.target != me),
                      key=lambda t: (t.target, t.item, t.share))
    incoming = sorted((t for t in transfers if t.target == me and t.source != me),
                      key=lambda t: (t.source, t.item, t.share))
    send_counts, sends = _pieces([(t.item, t.share, t.target, t.box) for t in outgoing], world)
    recv_counts, receives = _pieces([(t.item, t.share, t.source, t.box) for t in incoming], world)
    kept = [t for t in transfers if t.source == me and t.target == me]
    return Exchange(send_counts, recv_counts, sends, receives, kept, any(t.source != t.target for t in transfers))


def _pieces(entries: Sequence[tuple[int, int, int, Box]], world: int) -> tuple[list[int], list[Piece]]:
    """Lays out (item, share, peer, box) entries, already in buffer order, in one flat buffer."""
    counts = [0] * world
    pieces: list[Piece] = []
    offset = 0
    for item, share, peer, box in entries:
        numel = box_numel(box)
        pieces.append(Piece(item, share, peer, offset, box))
        counts[peer] += numel
        offset += numel
    return counts, pieces
