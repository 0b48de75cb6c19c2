"""Stand-ins for the launchers when the `triton` package is missing, so importing the package never fails."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

_MISSING = "Triton is not installed: {name} needs the `triton` package (pip install triton)"


def xxt(X: Tensor, out: Tensor | None = None, *, exact_fp32: bool = False) -> Tensor:
    raise RuntimeError(_MISSING.format(name="xxt"))


def ba_plus_caa(A: Tensor, b: float, c: float, out: Tensor | None = None, *, exact_fp32: bool = False) -> Tensor:
    raise RuntimeError(_MISSING.format(name="ba_plus_caa"))


def adamw_flagged_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                   exp_avg_sqs: Sequence[Tensor], steps: Sequence[Tensor], skipped: Tensor, *, lr: float | Tensor,
                   betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    raise RuntimeError(_MISSING.format(name="adamw_flagged_"))


def tabulate(tensors: Sequence[tuple[Tensor, ...]], skip_counts: Sequence[Tensor] | None = None) -> object:
    raise RuntimeError(_MISSING.format(name="tabulate"))


def tabulate_rounded(tensors: Sequence[tuple[Tensor | None, ...]],
                     skip_counts: Sequence[Tensor] | None = None) -> object:
    raise RuntimeError(_MISSING.format(name="tabulate_rounded"))


def launch_nonfinite_(tabulated: object) -> Tensor:
    raise RuntimeError(_MISSING.format(name="launch_nonfinite_"))


def launch_adamw_(tabulated: object, skipped: Tensor, *, lr: float | Tensor, betas: tuple[float, float], eps: float,
                  weight_decay: float, rates: Tensor | None = None) -> None:
    raise RuntimeError(_MISSING.format(name="launch_adamw_"))


def launch_counts_(tabulated: object, skipped: Tensor) -> None:
    raise RuntimeError(_MISSING.format(name="launch_counts_"))


def apply_takes(param: Tensor, update: Tensor) -> bool:
    raise RuntimeError(_MISSING.format(name="apply_takes"))


def launch_apply_(params: Sequence[Tensor], updates: Sequence[Tensor], decay: Tensor | None,
                  step_sizes: Sequence[float] | Tensor, indices: Sequence[int]) -> None:
    raise RuntimeError(_MISSING.format(name="launch_apply_"))


def launchable(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor) -> bool:
    raise RuntimeError(_MISSING.format(name="launchable"))


def launchable_rounded(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor,
                       rounding_count: Tensor, exp_avg_scales: Tensor | None, exp_avg_sq_scales: Tensor | None) -> bool:
    raise RuntimeError(_MISSING.format(name="launchable_rounded"))
