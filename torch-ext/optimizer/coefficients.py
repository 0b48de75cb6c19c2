"""Newton-Schulz coefficient schedules: named presets and the Polar Express construction.

A schedule is a list of (a, b, c) triples; step k maps each singular value x of the iterate to
a*x + b*x^3 + c*x^5 with the k-th triple.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from functools import lru_cache

import torch

Coefficients = tuple[float, float, float]

# Keller Jordan's Muon coefficients (also torch.optim.Muon's default), one triple for every step.
_ORIGINAL: tuple[Coefficients, ...] = ((3.4445, -4.7750, 2.0315),)

# modded-nanogpt's per-step schedule (train_gpt_medium.py); steps past the fifth repeat the last triple.
_QUINTIC: tuple[Coefficients, ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

COEFFICIENT_PRESETS: tuple[str, ...] = ("original", "quintic", "polar_express", "polar_express_safer")
# "polar_express_safer": modded-nanogpt's schedule with twice the safety margin, for low precision, computed for the
# step count (timm cuts its 8-step list, so the two agree at 8 steps).
_SAFER_SAFETY_EPS = 2e-2

# On [1 - w, 1] the minimax error of the best odd quintic is about 0.08 * w^3. Below this width it is under
# 1e-13, near the float64 noise in evaluating p, so Remez has nothing left to resolve and its linear system
# (condition ~ 1/w^3) only amplifies rounding; the limit polynomial, within O(w^2) of the minimax one, is
# used instead.
_NARROW_WIDTH = 1e-4
# The smallest singular value (relative to the largest, 1) the "polar_express" preset is fitted to: the authors'
# 1e-3 after Frobenius scaling. AOL scaling (preconditioner="aol") lifts the spectrum toward 1, and its schedule is
# fitted from 5e-3: with 4 steps that schedule ends in [0.908, 1.092], tighter than the Frobenius one's [0.869,
# 1.131] with 5, and on 256x1024 test matrices its polar error (spectral norm, float64) was 0.094 against 0.131 for
# Gaussian and 0.106 against 0.131 at condition number 10; at 1e3 it was 0.860 against 0.770 (both leave the
# smallest singular values unconverged).
_FROBENIUS_LOWER_BOUND = 1e-3
AOL_LOWER_BOUND = 5e-3
_REMEZ_MAX_ROUNDS = 100


@torch.compiler.assume_constant_result
def polar_express_coefficients(num_iters: int, l: float = 1e-3, safety_eps: float = 1e-2,
                               cushion: float = 0.02) -> list[Coefficients]:
    """The Polar Express schedule (Amsel, Chen, Goldstein, Musco, Persson, arXiv 2505.16932).

    Step k uses the odd quintic closest to 1 in the max norm on the interval [l_k, u_k] that holds every
    singular value at that step, starting from [l, 1] (the input is scaled so its spectral norm is at most 1
    and its smallest singular value of interest is at least l). The image [p(l_k), 2 - p(l_k)] is the next
    interval. `cushion` keeps the polynomial from being fitted on a lower bound below cushion * u_k (a
    polynomial that steep amplifies rounding); it is then rescaled so p(l_k) and p(u_k) are centred on 1.
    Every step but the last is evaluated at x / (1 + safety_eps), so values pushed slightly above the
    interval by low-precision rounding still map back inside it. The defaults give the authors' published
    schedule; results are cached.
    """
    _check_positive_int("num_iters", num_iters)
    _check_real("l", l, 0.0, 1.0, low_open=True, high_open=False)
    _check_real("safety_eps", safety_eps, 0.0, math.inf, low_open=False, high_open=True)
    _check_real("cushion", cushion, 0.0, 1.0, low_open=False, high_open=True)
    return list(_polar_express_schedule(num_iters, float(l), float(safety_eps), float(cushion)))


def resolve_coefficients(spec: str | Sequence[Coefficients], steps: int, preconditioner: str | None = None,
                         option: str = "coefficients") -> list[Coefficients]:
    """Exactly `steps` (a, b, c) triples from a preset name or a user schedule; the last triple repeats. Under
    `preconditioner="aol"` the "polar_express" preset is fitted to the interval AOL leaves (see `AOL_LOWER_BOUND`).
    Errors name `option`, the argument the user gave `spec` as."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"Invalid steps: {steps!r} (expected an integer >= 0)")
    if isinstance(spec, str):
        schedule = _preset(spec, steps, AOL_LOWER_BOUND if preconditioner == "aol" else _FROBENIUS_LOWER_BOUND,
                           option)
    else:
        schedule = _validated_schedule(spec, option)
    return [schedule[min(k, len(schedule) - 1)] for k in range(steps)]


def _preset(name: str, steps: int, lower_bound: float, option: str) -> Sequence[Coefficients]:
    if name == "original":
        return _ORIGINAL
    if name == "quintic":
        return _QUINTIC
    if name == "polar_express":
        return polar_express_coefficients(max(steps, 1), lower_bound)
    if name == "polar_express_safer":
        return polar_express_coefficients(max(steps, 1), lower_bound, _SAFER_SAFETY_EPS)
    raise ValueError(f"Invalid {option}: {name!r} (expected one of {', '.join(COEFFICIENT_PRESETS)} "
                     "or a sequence of (a, b, c) triples)")


def _validated_schedule(spec: object, option: str) -> list[Coefficients]:
    if not isinstance(spec, Sequence) or len(spec) == 0:
        raise ValueError(f"Invalid {option}: {spec!r} (expected a preset name or a non-empty sequence of "
                         "(a, b, c) triples)")
    if len(spec) == 3 and all(map(_is_real, spec)):
        spec = [spec]  # one flat (a, b, c), as torch.optim.Muon takes it, for every step
    schedule = []
    for index, triple in enumerate(spec):
        if isinstance(triple, str) or not isinstance(triple, Sequence) or len(triple) != 3:
            raise ValueError(f"Invalid {option}[{index}]: {triple!r} (expected a triple (a, b, c))")
        for value in triple:
            if not _is_real(value) or not math.isfinite(value):
                raise ValueError(f"Invalid {option}[{index}]: {triple!r} (expected three finite numbers)")
        schedule.append((float(triple[0]), float(triple[1]), float(triple[2])))
    return schedule


@lru_cache(maxsize=64)
def _polar_express_schedule(num_iters: int, l: float, safety_eps: float,
                            cushion: float) -> tuple[Coefficients, ...]:
    lower, upper = l, 1.0
    schedule = []
    for step in range(num_iters):
        a, b, c = _minimax_odd_quintic(max(lower, cushion * upper), upper)
        if cushion * upper > lower:
            # Fitted on the raised bound, so its errors at `lower` and `upper` are unequal: scale so they
            # straddle 1 symmetrically again.
            scale = 2.0 / (_quintic(a, b, c, lower) + _quintic(a, b, c, upper))
            a, b, c = a * scale, b * scale, c * scale
        if step < num_iters - 1:
            f = 1.0 + safety_eps
            a, b, c = a / f, b / f**3, c / f**5
        schedule.append((a, b, c))
        # Rounding could lift the bound a hair above 1 once converged; the band is centred on 1.
        lower = min(_quintic(a, b, c, lower), 1.0)
        upper = 2.0 - lower
    return tuple(schedule)


def _minimax_odd_quintic(lower: float, upper: float) -> Coefficients:
    """The odd quintic p minimizing max |1 - p(x)| over [lower, upper], with 0 < lower <= upper."""
    # The problem is scale invariant: solve on [lower / upper, 1] and rescale x -> x / upper.
    ratio = lower / upper
    if 1.0 - ratio < _NARROW_WIDTH:
        # Limit of the minimax polynomial as the interval shrinks to its midpoint m: p(m) = 1, p'(m) = p''(m) = 0.
        m = (1.0 + ratio) / 2.0
        a, b, c = 15 / 8 / m, -10 / 8 / m**3, 3 / 8 / m**5
    else:
        a, b, c = _remez_odd_quintic(ratio)
    return a / upper, b / upper**3, c / upper**5


def _remez_odd_quintic(lower: float) -> Coefficients:
    """Remez exchange on [lower, 1]: the best odd quintic equioscillates at lower < q < r < 1.

    There 1 - p takes the values E, -E, E, -E, with q and r the interior extrema (roots of p'), so each round
    solves that 4x4 linear system for (a, b, c, E) and moves q and r to the new roots of p'.
    """
    # Chebyshev-like start, exact as the interval shrinks.
    q, r = lower + (1.0 - lower) / 4, lower + 3 * (1.0 - lower) / 4
    error = math.inf
    for _ in range(_REMEZ_MAX_ROUNDS):
        a, b, c, new_error = _equioscillating_quintic((lower, q, r, 1.0))
        q, r = _positive_critical_points(a, b, c, lower)
        # p is O(1) on the interval, so E is only resolved to a few float64 ulps of 1.
        if abs(new_error - error) <= 4 * math.ulp(1.0):
            return a, b, c
        error = new_error
    raise RuntimeError(f"Remez exchange on [{lower!r}, 1] did not converge in {_REMEZ_MAX_ROUNDS} rounds")


def _equioscillating_quintic(nodes: tuple[float, float, float, float]) -> tuple[float, float, float, float]:
    rows = [[x, x**3, x**5, (-1.0) ** i] for i, x in enumerate(nodes)]
    # Explicitly on the CPU: a caller's default device (CUDA, or meta while building a model) must not apply.
    matrix = torch.tensor(rows, dtype=torch.float64, device="cpu")
    solution = torch.linalg.solve(matrix, torch.ones(4, dtype=torch.float64, device="cpu"))
    a, b, c, error = solution.tolist()
    return a, b, c, error


def _positive_critical_points(a: float, b: float, c: float, lower: float) -> tuple[float, float]:
    # p'(x) = a + 3b x^2 + 5c x^4 is a quadratic in x^2.
    discriminant = 9 * b * b - 20 * a * c
    if c <= 0 or discriminant <= 0:
        raise RuntimeError(f"Remez exchange on [{lower!r}, 1] lost its interior extrema (a={a}, b={b}, c={c})")
    root = math.sqrt(discriminant)
    q, r = math.sqrt((-3 * b - root) / (10 * c)), math.sqrt((-3 * b + root) / (10 * c))
    if not lower < q < r < 1.0:
        raise RuntimeError(f"Remez exchange on [{lower!r}, 1] moved its extrema outside the interval: {q}, {r}")
    return q, r


def _quintic(a: float, b: float, c: float, x: float) -> float:
    x2 = x * x
    return x * (a + x2 * (b + x2 * c))


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Invalid {name}: {value!r} (expected an integer >= 1)")


def _check_real(name: str, value: object, low: float, high: float, *, low_open: bool, high_open: bool) -> None:
    inside = _is_real(value) and (low < value if low_open else low <= value) and (
        value < high if high_open else value <= high)
    if not inside:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"Invalid {name}: {value!r} (expected a number in {interval})")
