"""Gradient clipping by the total norm, in one read of each gradient that also tells the next step which gradients are
finite, so that its non-finite guard need not read them again."""

from __future__ import annotations

import math
import numbers
import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from . import native
from .distributed.dtensors import is_dtensor
from .functional import picked

# torch.nn.utils.clip_grad_norm_'s guard against dividing by a zero norm.
_NORM_EPS = 1e-6
_READ_ONCE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_max_norm(max_norm: object) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or math.isnan(max_norm) or max_norm < 0:
        raise ValueError(f"Invalid max_norm: {max_norm!r} (expected a number >= 0, or math.inf to only measure)")
    return float(max_norm)


def reads_once(grads: Sequence[Tensor], norm_type: float) -> bool:
    """Whether `clip_grad_norm_` below serves these gradients: the L2 norm of plain tensors on the CPU, where the
    compiled `squared_norms_` op reads each one once. Everything else goes to torch.nn.utils.clip_grad_norm_."""
    return (float(norm_type) == 2.0 and len(grads) > 0 and not any(is_dtensor(grad) for grad in grads)
            and all(grad.device.type == "cpu" and grad.dtype in _READ_ONCE_DTYPES for grad in grads)
            and native.has_compiled_squared_norms("cpu"))


def tensor_norms_serve(grads: Sequence[Tensor]) -> bool:
    """Whether `clip_by_tensor_norms_` below serves these gradients: plain tensors on one device (where `reads_once`
    does not hold: GPUs, other norms, builds without the compiled op)."""
    return len(grads) > 0 and not any(is_dtensor(grad) for grad in grads) and len({g.device for g in grads}) == 1


def clip_by_tensor_norms_(grads: Sequence[Tensor], max_norm: float, norm_type: float, error_if_nonfinite: bool
                          ) -> tuple[Tensor, Tensor]:
    """torch.nn.utils.clip_grad_norm_'s arithmetic on one device, bit for bit where the gradients share a dtype:
    each gradient's norm by `torch._foreach_norm` (one multi-tensor call per dtype), the total the norm of those,
    every gradient multiplied by min(1, max_norm / (total + 1e-6)) without a host sync. Returns the total and (N,)
    float32 flags, 1.0 where a gradient is not finite after the scaling (the step's skip flags): its own norm tells,
    so the next step need not read it. A finite gradient whose norm overflows its dtype's accumulation (an entry
    beyond ~1e19 in float32) counts as not finite; its step is skipped, where torch's clip would have zeroed every
    gradient (the total is Inf too)."""
    norms, groups = native.tensor_norms(grads, norm_type)
    stacked = torch.stack(norms)
    # torch stacks the norms dtype group by dtype group: with one group, in the gradients' order.
    in_group_order = stacked if len(groups) == 1 else torch.stack([norms[i] for indices in groups for i in indices])
    total = torch.linalg.vector_norm(in_group_order, norm_type)
    if error_if_nonfinite and not bool(total.isfinite()):
        _raise_nonfinite(total)
    scale = (max_norm / (total + _NORM_EPS)).clamp(max=1.0)
    for indices in groups:
        torch._foreach_mul_([grads[i] for i in indices], scale)
    # scale is in [0, 1] or NaN: a norm times it is finite exactly where both are.
    return total, (stacked * scale).isfinite().logical_not().to(torch.float32)


def _raise_nonfinite(total: Tensor) -> None:
    raise RuntimeError(f"The total norm of the gradients is {float(total)}, so they cannot be clipped; "
                       "error_if_nonfinite=False scales them by the non-finite factor instead (the step then "
                       "skips every parameter whose gradient is not finite)")


def clip_grad_norm_(grads: Sequence[Tensor], max_norm: float, error_if_nonfinite: bool = False
                    ) -> tuple[Tensor, Tensor]:
    """Scales `grads` in place by min(1, max_norm / (total + 1e-6)), `total` being the L2 norm of all of them, as
    torch.nn.utils.clip_grad_norm_ does (a scale of exactly 1 is skipped: it changes nothing). Returns `total`
    (float32, float64 if a gradient is) and (N,) float32 flags, 1.0 where a gradient is not finite after the scaling.

    Each gradient is read once (`reads_once` must hold): its sum of squares in float64, finite exactly when the
    gradient is (float64 gradients, whose squares can overflow, are checked apart). The total is accumulated in
    float64 too, so it is the exact norm up to rounding where torch's float32 and 16-bit sums drift (0.3% on a
    float32 embedding gradient of 38.6M elements). A non-finite total raises with `error_if_nonfinite`, before
    anything is scaled; without it every gradient is scaled by the non-finite factor, as torch does."""
    sums = native.squared_norms(grads)
    finite = sums.isfinite()
    wide = [i for i, grad in enumerate(grads) if grad.dtype == torch.float64]
    if wide:
        finite[wide] = native.finite_flags([grads[i] for i in wide]).bool()
    total = sums.sum().sqrt().to(torch.float64 if wide else torch.float32)
    if error_if_nonfinite and not bool(total.isfinite()):
        _raise_nonfinite(total)
    scale = (max_norm / (total + _NORM_EPS)).clamp(max=1.0)
    if float(scale) != 1.0:
        torch._foreach_mul_(list(grads), scale)
    return total, (finite & scale.isfinite()).logical_not().to(torch.float32)


class CheckedGradients:
    """The non-finite flags a clip left for the next step, each valid while its parameter's gradient is still the
    tensor that was checked, unchanged since (same tensor, same version counter: in-place writes bump it, except
    writes through `.data`). Parameters and gradients are held weakly: a parameter removed from the optimizer is freed
    with its model (a step of Muon parameters alone kept the flags, and every clipped parameter, until the next clip),
    and a gradient set to None and freed is simply no longer checked."""

    def __init__(self, params: Sequence[Tensor], nonfinite: Tensor) -> None:
        self._nonfinite = nonfinite
        # By id, each with a weak reference that tells a freed parameter's id reused from it. An inference tensor (a
        # gradient set under inference mode) has no version counter: its flag is not kept.
        self._checked = {id(param): (weakref.ref(param), weakref.ref(param.grad),
                                     None if param.grad.is_inference() else param.grad._version, index)
                         for index, param in enumerate(params)}

    def found_inf(self, params: Sequence[Tensor]) -> Tensor | None:
        """(N,) float32, 1.0 where params[i]'s gradient is not finite, if every one of them was checked and is
        unchanged; else None (the step reads them itself). Not to be written: it may be a slice of the clip's."""
        indices = []
        for param in params:
            checked = self._checked.get(id(param))
            if checked is None:
                return None
            param_ref, grad_ref, version, index = checked
            if (param_ref() is not param or grad_ref() is not param.grad or version is None
                    or param.grad._version != version):
                return None
            indices.append(index)
        return picked(self._nonfinite, indices)
