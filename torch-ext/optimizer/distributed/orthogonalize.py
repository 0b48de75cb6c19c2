"""The math an owner and every rank do on plain tensors: batched Newton-Schulz and the update of a local shard."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .. import native
from ..functional import LearningRate, decay_factors
from ..newton_schulz import Orthogonalizer
from ..routing import MatrixView


def orthogonalize(fulls: Sequence[Tensor], views: Sequence[MatrixView], finite: Sequence[Tensor], *,
                  orthogonalizer: Orthogonalizer, out_dtype: torch.dtype) -> list[Tensor]:
    """Newton-Schulz of each whole parameter (in its own layout), one batched call per matrix shape.

    A parameter whose flag is 0 gets an exact zero, as on a single device. Results are in `out_dtype`, laid out
    like the parameter.
    """
    results: list[Tensor | None] = [None] * len(fulls)
    buckets: dict[tuple[int, int], list[int]] = {}
    for index, view in enumerate(views):
        buckets.setdefault((view.rows, view.cols), []).append(index)
    for indices in buckets.values():
        stack = torch.cat([views[i].to_matrices(fulls[i]).to(orthogonalizer.staging_dtype(fulls[i].dtype))
                           for i in indices])
        orthogonal = orthogonalizer(stack)
        batches = [views[i].batch for i in indices]
        keep = torch.cat([finite[i].expand(views[i].batch) for i in indices]).view(-1, 1, 1) > 0
        orthogonal = torch.where(keep, orthogonal, 0.0)
        for i, part in zip(indices, orthogonal.split(batches)):
            results[i] = views[i].from_matrices(part, fulls[i].shape).to(out_dtype)
    return results


def apply_update(param: Tensor, update: Tensor, finite: Tensor, nonfinite_skips: Tensor, *, lr: LearningRate,
                 weight_decay: float, step_size: LearningRate) -> None:
    """Decoupled weight decay, then `param -= step_size * update`, on one rank's shard; a skipped parameter
    (flag 0, the same on every rank) is left as it is and counted."""
    skipped = finite.eq(0)
    nonfinite_skips.add_(skipped)
    if param.numel() == 0:
        return
    decay = decay_factors(skipped.reshape(1), lr, weight_decay, param.dtype) if weight_decay != 0 else None
    native.apply_update_([param], [update], decay, [-step_size])
