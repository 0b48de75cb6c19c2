"""Option values in the forms users give them (Python, numpy and one-element tensor numbers, read as Python numbers
by one rule), and the checks of the options that more than the optimizer's groups take."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor


def is_real_scalar(value: Tensor) -> bool:
    return value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool


def as_real(value: Any) -> float | None:
    """A Python, numpy or one-element tensor real number as a float; None for anything else (bool included).

    torch optimizers take a tensor lr, so that a compiled training loop does not recompile as the schedule moves it,
    and numpy scalars come from configuration libraries. Python floats and ints are answered before the `numbers.Real`
    check, an abstract class's, which the step asks of every option of every group."""
    if type(value) in (float, int):
        return _as_float(value)
    if isinstance(value, Tensor):
        return float(value) if is_real_scalar(value) else None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return _as_float(value)


def _as_float(value: numbers.Real) -> float:
    try:
        return float(value)
    except OverflowError:  # an int (or Fraction) beyond float's range: as far out as a float goes
        return math.inf if value > 0 else -math.inf


def as_integer(value: Any) -> int | None:
    """A Python or numpy integer, or a one-element integer tensor, as an int; None for anything else (bool included)."""
    # None (an unset option) is answered before operator.index: torch 2.10's compiler cannot trace the TypeError.
    if value is None or isinstance(value, bool) or (isinstance(value, Tensor) and (
            value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)):
        return None
    try:
        return operator.index(value)
    except TypeError:  # also a tensor of several elements
        return None


def check_bool(name: str, value: Any, optional: bool = False) -> None:
    if not isinstance(value, bool) and not (optional and value is None):  # not `in (False, True)`: 1 == True
        raise ValueError(f"Invalid {name}: {value!r} (expected {'None, ' if optional else ''}True or False)")


def overflowed_to_infinity(value: float, dtype: torch.dtype) -> float:
    """`value`, or the infinity it rounds to in `dtype` where it is beyond the dtype's range: as torch's arithmetic
    with a Python number (torch.optim's AdamW and Muon) rounds it, where a fill or a clamp with it raises, which would
    stop a step part way."""
    return value if abs(value) <= torch.finfo(dtype).max else math.copysign(math.inf, value)


def is_one_of(value: Any, allowed: Iterable[Any]) -> bool:
    """`value in allowed`, False where comparing is elementwise (an array or a tensor of several elements, whose
    truth value numpy and torch refuse)."""
    try:
        return value in allowed
    except (ValueError, RuntimeError):
        return False


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = tuple(allowed)
    if not is_one_of(value, allowed):
        raise ValueError(f"Invalid {name}: {value!r} (expected one of {', '.join(map(repr, allowed))})")


# Each Newton-Schulz step costs three matrix products, and no schedule here improves past about ten steps.
MAX_NS_STEPS = 100


def check_ns_steps(value: Any, name: str = "ns_steps") -> int:
    """Newton-Schulz steps as an int, if it is an integer in [1, MAX_NS_STEPS]."""
    steps = as_integer(value)
    if steps is None or not 1 <= steps <= MAX_NS_STEPS:
        raise ValueError(f"Invalid {name}: {value!r} (expected an integer in [1, {MAX_NS_STEPS}]; each step costs "
                         "three matrix products and no schedule improves past about ten)")
    return steps


def check_chunk_size(value: Any) -> None:
    if value is not None and not (as_integer(value) or 0) >= 1:
        raise ValueError(f"Invalid chunk_size: {value!r} (expected None or an integer >= 1)")


# The dtypes products and collectives run in (float8 has neither matrix products nor arithmetic in torch).
_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_float_dtype(name: str, value: Any, optional: bool = False) -> None:
    if value not in _COMPUTE_DTYPES and not (optional and value is None):
        raise ValueError(f"Invalid {name}: {value!r} (expected {'None or ' if optional else ''}one of "
                         f"{', '.join(map(str, _COMPUTE_DTYPES))})")
