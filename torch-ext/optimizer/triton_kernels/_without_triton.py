"""Stand-ins for the launchers when the `triton` package is missing, so importing the package never fails."""

from __future__ import annotations

from torch import Tensor

_MISSING = "Triton is not installed: {name} needs the `triton` package (pip install triton)"


def xxt(X: Tensor, out: Tensor | None = None, *, exact_fp32: bool = False) -> Tensor:
    raise RuntimeError(_MISSING.format(name="xxt"))


def ba_plus_caa(A: Tensor, b: float, c: float, out: Tensor | None = None, *, exact_fp32: bool = False) -> Tensor:
    raise RuntimeError(_MISSING.format(name="ba_plus_caa"))
