"""Adam-style second moments of the orthogonalized update: NorMuon's per output neuron, AdaMuon's per element.

After Newton-Schulz, each matrix O of a parameter is divided by the square root of a running mean of its squares:
per row (output neuron) for "neuron" (NorMuon, arXiv 2510.05491), per entry for "element" (AdaMuon, arXiv
2507.11005). Under the RMS rule ("match_rms_adamw") the result is then rescaled so that the parameter's whole update
has RMS 0.2, as both papers do; other lr scalings use the bias-corrected moment and scale as plain Muon does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from . import native
from .routing import MatrixView

NORMALIZATIONS: tuple[str | None, ...] = (None, "neuron", "element")
# The RMS both papers give the normalized update, AdaMuon's and NorMuon's equivalent of Moonshot's 0.2 * sqrt(max dim).
_RMS = 0.2


def second_moment_shape(shape: Sequence[int], view: MatrixView, normalization: str) -> tuple[int, ...]:
    """The state of a parameter of `shape` seen as `view`, laid out like the parameter so that it shards as the
    parameter does: one entry per element for "element"; for "neuron", one per row, the parameter's shape with the
    dims a row runs along reduced to 1."""
    if normalization == "neuron":
        return tuple(1 if dim in view.column_dims else size for dim, size in enumerate(shape))
    return tuple(shape)


def uses_rms_rule(normalization: str | None, adjust_lr_fn: str | None) -> bool:
    """Whether the update is rescaled to RMS 0.2 (which makes a bias correction of the moment moot)."""
    return normalization is not None and adjust_lr_fn == "match_rms_adamw"


def moment_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """Second moments are float32, or float64 for float64 parameters (as AdamW's moments are for them)."""
    return torch.promote_types(param_dtype, torch.float32)


def row_squares(updates: Sequence[Tensor], views: Sequence[MatrixView], dtype: torch.dtype) -> list[Tensor]:
    """What each update (in its parameter's layout, or a shard of it) adds to NorMuon's second moment before the
    mean: the sum of its squares along each row. A shard that holds part of a row sums only its part; the caller adds
    the other shards' sums. The row sums are norms squared: one pass over each update, where widening, squaring and
    summing took three (2x the time on GPT-2's bf16 updates, 2-core Xeon), and the squares one launch for all."""
    norms = [torch.linalg.vector_norm(_in_moment_dtype(update, dtype), dim=view.column_dims, keepdim=True, dtype=dtype)
             for update, view in zip(updates, views)]
    return torch._foreach_mul(norms, norms)


def _in_moment_dtype(update: Tensor, dtype: torch.dtype) -> Tensor:
    """The update where ops that promote it reach `dtype` (a moment dtype, `moment_dtype`): itself, or where it is
    wider (a float64 iteration's), rounded to `dtype` (vector_norm and the division only widen). Told by the dtypes'
    sizes, which order float dtypes as promotion does: `torch.promote_types` is an operator call (two a matrix here)."""
    return update if update.dtype.itemsize <= dtype.itemsize else update.to(dtype)


def normalize(updates: Sequence[Tensor], row_sums: Sequence[Tensor] | None, second_moments: Sequence[Tensor],
              steps: Sequence[Tensor], skipped: Tensor, views: Sequence[MatrixView], normalization: str, beta: float,
              eps: float, bias_correction: bool, sums_of_squares: bool = False) -> tuple[list[Tensor], Tensor | None]:
    """Each parameter's orthogonalized update (in its layout) divided by sqrt(v̂) + eps, after its second moment v
    moved toward the mean of its squares (per row for "neuron", per entry for "element"), in place, with its step
    count. A skipped parameter (its `skipped` entry True) has an all-zero update: its v decays by 1 and gains 0, so it
    and its step stay exactly as they were. Returns the normalized updates and, with `sums_of_squares`, each one's
    ‖U‖² as an (N,) float64 tensor (what the RMS rule scales by), else None: float64 whichever pass ran, since the
    ranks of a distributed step add their shards' sums in one all-reduce, and the shards of one parameter may differ
    in layout (one rank's compiled pass, another's composition).

    `row_sums` ("neuron" only): whole rows' sums from `row_squares`, for updates that are shards of their rows; None
    where every update holds whole rows (then "element" too). On the CPU the compiled passes serve where they can (see
    `_compiled_pass`), in place. The composition below took ~300 ms of NorMuon's and ~430 ms of
    AdaMuon's GPT-2-small step (2-core Xeon), its ops of mixed dtypes each converting an input through a copy."""
    dtype = second_moments[0].dtype
    decays = torch.full(skipped.shape, beta, dtype=dtype, device=skipped.device).masked_fill_(skipped, 1.0)
    torch._foreach_add_(list(steps), list((~skipped).to(torch.float32).unbind()))
    # clamped for a parameter every step of which was skipped: its v is 0, and 0 / eps = 0
    corrections = ([(1.0 - torch.pow(beta, step.to(dtype))).clamp(min=1.0 - beta) for step in steps]
                   if bias_correction else None)
    compiled = _compiled_pass(updates, row_sums, second_moments, views, normalization)
    if compiled is not None:
        totals = compiled(updates, second_moments, decays, _stacked(corrections, decays), 1.0 - beta, eps)
        return list(updates), totals if sums_of_squares else None
    normalized = _composed(updates, row_sums, second_moments, decays, corrections, views, normalization, beta, eps)
    if not sums_of_squares:
        return normalized, None
    return normalized, _sums_of_squares(normalized)


def _compiled_pass(updates: Sequence[Tensor], row_sums: Sequence[Tensor] | None, moments: Sequence[Tensor],
                   views: Sequence[MatrixView], normalization: str) -> Callable[..., Tensor] | None:
    """The compiled op that takes these updates whole, in place, on their device, or None: `normalize_rows_` for
    whole matrices' rows ("neuron", row_sums None), `normalize_elements_` ("element"); both read an update
    contiguous or stored transposed (a tall matrix's Newton-Schulz result), its moment contiguous."""
    if not updates or not all(native.is_contiguous_or_transposed(update) and moment.is_contiguous()
                              for update, moment in zip(updates, moments)):
        return None
    device_type = updates[0].device.type
    if (normalization == "neuron" and row_sums is None and native.has_compiled_normalize_rows(device_type)
            and all(view.row_dim == update.ndim - 2 and view.column_dims == (update.ndim - 1,)
                    and moment.numel() * view.cols == update.numel()
                    for update, moment, view in zip(updates, moments, views))):
        return native.normalize_rows_
    if (normalization == "element" and native.has_compiled_normalize_elements(device_type)
            and all(update.shape == moment.shape for update, moment in zip(updates, moments))):
        return native.normalize_elements_
    return None


def _stacked(corrections: Sequence[Tensor] | None, decays: Tensor) -> Tensor:
    """The compiled passes' corrections, one per parameter: ones where there is no bias correction."""
    return torch.stack(corrections) if corrections is not None else torch.ones_like(decays)


def _composed(updates: Sequence[Tensor], row_sums: Sequence[Tensor] | None, second_moments: Sequence[Tensor],
              decays: Tensor, corrections: Sequence[Tensor] | None, views: Sequence[MatrixView], normalization: str,
              beta: float, eps: float) -> list[Tensor]:
    """`normalize` in torch ops: every device, dtype and layout, and shards of rows."""
    dtype = second_moments[0].dtype
    if normalization == "neuron":
        if row_sums is None:
            row_sums = row_squares(updates, views, dtype)
        # One launch for all, a true division (a CUDA tensor over a number multiplies by the number's reciprocal)
        means = torch._foreach_div(list(row_sums), [float(view.cols) for view in views])
    else:  # the squares in one launch for all, of the updates in dtype (a cast each where their dtype is another)
        widened = [update.to(dtype) for update in updates]
        means = torch._foreach_mul(widened, widened)
    torch._foreach_mul_(list(second_moments), list(decays.unbind()))
    torch._foreach_add_(list(second_moments), means, alpha=1.0 - beta)
    # The roots and their eps in two launches for all, where a root and an add took two per parameter; same roundings.
    denominators = torch._foreach_sqrt(list(second_moments) if corrections is None
                                       else torch._foreach_div(list(second_moments), list(corrections)))
    torch._foreach_add_(denominators, eps)
    # In place, as the compiled passes are: the quotient, computed in dtype (the update promoted in the division), is
    # rounded once to the update's dtype as it is stored, one launch a parameter where a cast, the division and a cast
    # back took three. A wider update (a float64 iteration's) is rounded to dtype first, as the division would not.
    for update, denominator in zip(updates, denominators):
        numerator = _in_moment_dtype(update, dtype)
        if numerator is update:
            update.div_(denominator)
        else:
            update.copy_(numerator / denominator)
    return list(updates)


def rms_rule_scales(sums_of_squares: Tensor, views: Sequence[MatrixView], eps: float) -> list[Tensor]:
    """The factors that give each parameter's normalized update U (all its matrices) RMS 0.2, 0.2 sqrt(numel) / ‖U‖,
    from the (N,) ‖U‖² (each summed over every shard of its U): 0-dim tensors made in four launches for all, the
    roundings of `0.2 sqrt(numel) / (‖U‖ + eps)` per parameter, whose three ops each took a launch a parameter on
    a GPU (~150 for GPT-2 small's 48 matrices)."""
    reciprocals = sums_of_squares.sqrt().add_(eps).reciprocal_()  # a number over a tensor is its reciprocal times it
    return torch._foreach_mul(list(reciprocals.unbind()),
                              [_RMS * math.sqrt(view.batch * view.rows * view.cols) for view in views])


def _sums_of_squares(updates: Sequence[Tensor]) -> Tensor:
    """Each update's ‖U‖², accumulated in its second moment's dtype, as an (N,) float64 tensor: a norm per update
    (one pass over it), the squares one launch for all."""
    norms = [torch.linalg.vector_norm(update, dtype=moment_dtype(update.dtype)) for update in updates]
    return torch.stack(torch._foreach_mul(norms, norms)).to(torch.float64)
