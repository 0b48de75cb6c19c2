"""What each all-to-all moves: pure bookkeeping over layouts and shares, no communication.

Every rank computes the plan of every exchange from the same shapes, placements and shares, so all ranks agree on the
split sizes and on whether an exchange moves any data at all (when none does, no rank launches it). `plan_step`
counts the bytes of every rank from the same transfers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

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
    """`me`'s side of a chunk's gather and scatter, planned from the transfers `me` sends or receives alone: every
    rank's (a share from each of hundreds of ranks, as FSDP2's Shard(1) or a replicated bank asks) took seconds."""
    world = layouts[0].world
    return (exchange(gather_transfers(layouts, shares, me), world, me, _gather_moves_data(layouts, shares)),
            exchange(scatter_transfers(layouts, shares, me), world, me, _scatter_moves_data(layouts, shares)))


def gather_transfers(layouts: Sequence[ShardLayout], shares: Sequence[Sequence[Share]],
                     rank: int | None = None) -> list[Transfer]:
    """Each share's part of every distinct box travels to the share's owner, from the owner itself when it holds
    that box, else from the lowest rank that does. Given `rank`: only the transfers that rank sends or receives."""
    transfers = []
    for item, (layout, item_shares) in enumerate(zip(layouts, shares)):
        for index, share in enumerate(item_shares):
            wanted = share.box(layout.shape)
            sources = layout.sources(share.owner)
            if rank not in (None, share.owner):
                sources = [rank] if rank in sources else []
            for source in sources:
                part = intersection(layout.boxes[source], wanted)
                if part is not None:
                    transfers.append(Transfer(item, index, source, share.owner, part))
    return transfers


def scatter_transfers(layouts: Sequence[ShardLayout], shares: Sequence[Sequence[Share]],
                      rank: int | None = None) -> list[Transfer]:
    """Each share's owner sends every rank the part of the orthogonalized share that rank holds. Given `rank`: only
    the transfers that rank sends or receives."""
    transfers = []
    for item, (layout, item_shares) in enumerate(zip(layouts, shares)):
        for index, share in enumerate(item_shares):
            made = share.box(layout.shape)
            for target in range(layout.world) if rank in (None, share.owner) else (rank,):
                part = intersection(made, layout.boxes[target])
                if part is not None:
                    transfers.append(Transfer(item, index, share.owner, target, part))
    return transfers


def gather_numels(layouts: Sequence[ShardLayout], shares: Sequence[Sequence[Share]]) -> tuple[list[int], list[int]]:
    """The elements each rank sends to and receives from other ranks in the gather: `transfer_numels` of every
    rank's `gather_transfers`, counted without listing them (at hundreds of ranks the list takes seconds)."""
    world = layouts[0].world
    sent, received = torch.zeros(world, dtype=torch.int64), torch.zeros(world, dtype=torch.int64)
    for layout, item_shares in zip(layouts, shares):
        for share in item_shares:
            sources = torch.tensor([rank for rank in layout.sources(share.owner) if rank != share.owner],
                                   dtype=torch.int64)
            parts = layout.overlap_numels(share.box(layout.shape))[sources]
            sent.index_add_(0, sources, parts)
            received[share.owner] += parts.sum()
    return sent.tolist(), received.tolist()


def scatter_numels(layouts: Sequence[ShardLayout], shares: Sequence[Sequence[Share]]) -> tuple[list[int], list[int]]:
    """The elements each rank sends to and receives from other ranks in the scatter: `transfer_numels` of every
    rank's `scatter_transfers`, counted without listing them."""
    world = layouts[0].world
    sent, received = torch.zeros(world, dtype=torch.int64), torch.zeros(world, dtype=torch.int64)
    for layout, item_shares in zip(layouts, shares):
        for share in item_shares:
            parts = layout.overlap_numels(share.box(layout.shape))
            parts[share.owner] = 0
            received += parts
            sent[share.owner] += parts.sum()
    return sent.tolist(), received.tolist()


def transfer_numels(transfers: Sequence[Transfer], world: int) -> tuple[list[int], list[int]]:
    """The elements each rank sends to and receives from other ranks: `transfers` (every rank's) counted."""
    sent, received = [0] * world, [0] * world
    for transfer in transfers:
        if transfer.source != transfer.target:
            sent[transfer.source] += box_numel(transfer.box)
            received[transfer.target] += box_numel(transfer.box)
    return sent, received


def _gather_moves_data(layouts: Sequence[ShardLayout], shares: Sequence[Sequence[Share]]) -> bool:
    """Whether some share's owner lacks part of it: distinct boxes are disjoint and cover the tensor, so another
    rank then sends what the owner's own box leaves out."""
    return any(_owner_lacks_part(layout, share) for layout, item_shares in zip(layouts, shares)
               for share in item_shares)


def _scatter_moves_data(layouts: Sequence[ShardLayout], shares: Sequence[Sequence[Share]]) -> bool:
    """Whether some rank besides a share's owner holds part of it: the part the owner lacks, or the owner's own box
    (a replica's)."""
    return any(_owner_lacks_part(layout, share)
               or (box_numel(share.box(layout.shape)) > 0 and layout.holders_of(share.owner) != (share.owner,))
               for layout, item_shares in zip(layouts, shares) for share in item_shares)


def _owner_lacks_part(layout: ShardLayout, share: Share) -> bool:
    box = share.box(layout.shape)
    held = intersection(layout.boxes[share.owner], box)
    return (0 if held is None else box_numel(held)) != box_numel(box)


def exchange(transfers: Sequence[Transfer], world: int, me: int, moves_data: bool | None = None) -> Exchange:
    """`me`'s side of the all-to-all that carries `transfers` (those `me` sends or receives, at least): sends in
    peer-then-item order, receives likewise. `moves_data`: whether any rank sends to another; None: `transfers`
    are every rank's, and say."""
    outgoing = sorted((t for t in transfers if t.source == me and t.target != me),
                      key=lambda t: (t.target, t.item, t.share))
    incoming = sorted((t for t in transfers if t.target == me and t.source != me),
                      key=lambda t: (t.source, t.item, t.share))
    send_counts, sends = _pieces([(t.item, t.share, t.target, t.box) for t in outgoing], world)
    recv_counts, receives = _pieces([(t.item, t.share, t.source, t.box) for t in incoming], world)
    kept = [t for t in transfers if t.source == me and t.target == me]
    if moves_data is None:
        moves_data = any(t.source != t.target for t in transfers)
    return Exchange(send_counts, recv_counts, sends, receives, kept, moves_data)


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
