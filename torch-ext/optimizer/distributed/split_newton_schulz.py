"""Newton-Schulz of matrices whose columns (of the wide orientation) are divided between several owners.

Each owner holds a block X_j of columns. The Frobenius norm is the square root of the sum of the blocks' squares,
and the Gram matrix A = X Xᵀ the sum of the blocks' X_j X_jᵀ: the owners exchange these parts (one all-to-all for
every divided matrix of a chunk, launched by every rank so that all agree) and each adds them up in share order,
so every owner holds the same A. A step then maps its own block alone: X_j <- a X_j + b A X_j + c A (A X_j), the
standard iteration's polynomial applied without forming A², which would cost every owner the whole m³.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..dispatch import resolve_backend, symmetric_gram
from ..newton_schulz import Orthogonalizer, aol_scaled, norm_denominator
from . import comm
from .plan import Transfer, exchange

Key = tuple[int, int]  # (item, share)


def split_newton_schulz(blocks: Mapping[Key, Tensor], owners: Mapping[int, Sequence[int]],
                        shapes: Mapping[int, tuple[int, int]], finite: Mapping[int, Tensor], *,
                        orthogonalizer: Orthogonalizer, rank: int, world: int, group: dist.ProcessGroup,
                        device: torch.device) -> Generator[None, None, dict[Key, Tensor]]:
    """This rank's blocks (item, share) -> its columns of the item's matrix in the item's own (out, in) orientation,
    in the staging dtype; `owners[item]`: the owner of each share of every divided item of the chunk (the same on
    every rank); `shapes[item]`: the whole matrix's (out, in). Yields after launching each exchange. Returns the
    orthogonalized blocks, in the iteration's dtype (zero where `finite` is 0)."""
    tall = {item: rows > cols for item, (rows, cols) in shapes.items()}
    wide = {key: block.mT if tall[key[0]] else block for key, block in blocks.items()}
    squares = {key: block.float().square().sum().reshape(1) for key, block in wide.items()}
    exchange_on = (rank, world, group, device)  # every rank sends the same dtype, also a rank with no share
    norms = yield from _summed(squares, owners, {item: (1,) for item in owners}, torch.float32, *exchange_on)
    X = {key: (block / norm_denominator(norms[key[0]].sqrt(), shapes[key[0]], orthogonalizer.eps,
                                        orthogonalizer.safety_factor, orthogonalizer.scale_eps)
               ).to(orthogonalizer.dtype) for key, block in wide.items()}
    backend = {key: resolve_backend(None, block.shape, block.dtype, block.device) for key, block in X.items()}
    gram_shapes = {item: (min(shape),) * 2 for item, shape in shapes.items()}
    for step, (a, b, c) in enumerate(orthogonalizer.coefficients):
        partial = {key: symmetric_gram(block, backend[key]) for key, block in X.items()}
        sums = yield from _summed(partial, owners, gram_shapes, orthogonalizer.dtype, *exchange_on)
        gram = {key: sums[key[0]].to(block.dtype) for key, block in X.items()}
        if step == 0 and orthogonalizer.preconditioner == "aol":
            for key in X:
                X[key], gram[key] = aol_scaled(X[key], gram[key], orthogonalizer.eps)
        for key, block in X.items():
            product = gram[key] @ block
            X[key] = torch.addmm(product, gram[key], product, beta=b, alpha=c).add_(block, alpha=a)
    return {key: torch.where(finite[key[0]] > 0, block.mT if tall[key[0]] else block, 0.0)
            for key, block in X.items()}


def _summed(values: Mapping[Key, Tensor], owners: Mapping[int, Sequence[int]],
            shapes: Mapping[int, tuple[int, ...]], dtype: torch.dtype, rank: int, world: int,
            group: dist.ProcessGroup, device: torch.device) -> Generator[None, None, dict[int, Tensor]]:
    """For each item this rank holds a share of: the float32 sum of every share's value (sent in `dtype`), in share
    order."""
    plan = exchange(among_owners(owners, shapes), world, rank)
    sends = [values[piece.item, _my_share(owners, piece.item, rank)].reshape(-1).to(dtype) for piece in plan.sends]
    send = torch.cat(sends) if sends else torch.empty(0, dtype=dtype, device=device)
    work, received = comm.launch_all_to_all(send, plan, group)
    yield
    comm.wait(work)
    parts = {(piece.item, piece.share): received.narrow(0, piece.offset, math.prod(shapes[piece.item]))
             for piece in plan.receives}
    sums = {}
    for item, share in values:
        total = torch.zeros(shapes[item], dtype=torch.float32, device=device)
        for index in range(len(owners[item])):
            part = values[item, share] if index == share else parts[item, index]
            total += part.reshape(shapes[item]).float()
        sums[item] = total
    return sums


def _my_share(owners: Mapping[int, Sequence[int]], item: int, rank: int) -> int:
    return list(owners[item]).index(rank)


def among_owners(owners: Mapping[int, Sequence[int]], shapes: Mapping[int, tuple[int, ...]]) -> list[Transfer]:
    """Every owner's value to every other owner of the same item."""
    return [Transfer(item, share, source, target, tuple(slice(0, size) for size in shapes[item]))
            for item, item_owners in owners.items() for share, source in enumerate(item_owners)
            for target in item_owners if target != source]
