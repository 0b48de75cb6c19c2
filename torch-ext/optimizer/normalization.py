"""Adam-style second moments of the orthogonalized update: NorMuon's per output neuron, AdaMuon's per element.

After Newton-Schulz, each matrix O of a parameter is divided by the square root of a running mean of its squares:
per row (output neuron) for "neuron" (NorMuon, arXiv 2510.05491), per entry for "element" (AdaMuon, arXiv
2507.11005). Under the RMS rule ("match_rms_adamw") the result is then rescaled so that the parameter's whole update
has RMS 0.2, as both papers do; other lr scalings use the bias-corrected moment and scale as plain Muon does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .routing import MatrixView

NORMALIZATIONS: tuple[str | None, ...] = (None, "neuron", "element")
# The RMS both papers give the normalized update, AdaMuon's and NorMuon's equivalent of Moonshot's 0.2 * sqrt(max dim).
_RMS = 0.2


def second_moment_shape(view: MatrixView, normalization: str) -> tuple[int, ...]:
    """The state of a parameter seen as `view`: one entry per row of each matrix, or one per entry."""
    if normalization == "neuron":
        return (view.batch, view.rows)
    return (view.batch, view.rows, view.cols)


def uses_rms_rule(normalization: str | None, adjust_lr_fn: str | None) -> bool:
    """Whether the update is rescaled to RMS 0.2 (which makes a bias correction of the moment moot)."""
    return normalization is not None and adjust_lr_fn == "match_rms_adamw"


def moment_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """Second moments are float32, or float64 for float64 parameters (as AdamW's moments are for them)."""
    return torch.promote_types(param_dtype, torch.float32)


def normalize(parts: Sequence[Tensor], second_moments: Sequence[Tensor], steps: Sequence[Tensor], skipped: Tensor,
              normalization: str, beta: float, eps: float, bias_correction: bool) -> list[Tensor]:
    """Each parameter's orthogonalized matrices (batch, rows, cols) divided by sqrt(v̂) + eps, after its second
    moment v moved toward their squares (in place, with its step count). A skipped parameter (its `skipped` entry
    True) has all-zero parts: its v decays by 1 and gains 0, so it and its step stay exactly as they were."""
    dtype = second_moments[0].dtype
    widened = [part.to(dtype) for part in parts]
    squares = [part.square() for part in widened]
    if normalization == "neuron":
        squares = [square.mean(dim=-1) for square in squares]
    decays = torch.full(skipped.shape, beta, dtype=dtype, device=skipped.device).masked_fill_(skipped, 1.0)
    torch._foreach_mul_(list(second_moments), list(decays.unbind()))
    torch._foreach_add_(list(second_moments), squares, alpha=1.0 - beta)
    torch._foreach_add_(list(steps), list((~skipped).to(torch.float32).unbind()))
    normalized = []
    for part, widened_part, moment, step in zip(parts, widened, second_moments, steps):
        if bias_correction:  # clamped for a parameter every step of which was skipped: its v is 0, and 0 / eps = 0
            moment = moment / (1.0 - torch.pow(beta, step.to(dtype))).clamp(min=1.0 - beta)
        denominator = moment.sqrt().add_(eps)
        if normalization == "neuron":
            denominator = denominator.unsqueeze(-1)
        normalized.append((widened_part / denominator).to(part.dtype))
    return normalized


def rms_rule_scale(update: Tensor, view: MatrixView, eps: float) -> Tensor:
    """The factor that gives one parameter's normalized update (all its matrices) RMS 0.2: 0.2 sqrt(numel) / ‖U‖."""
    numel = view.batch * view.rows * view.cols
    return (_RMS * math.sqrt(numel)) / update.norm(dtype=moment_dtype(update.dtype)).add(eps)
