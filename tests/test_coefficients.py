"""Coefficient schedules against published numbers, torch's Muon defaults, and the minimax property itself."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.optim._muon as torch_muon

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))

from optimizer.coefficients import (  # noqa: E402
    COEFFICIENT_PRESETS,
    polar_express_coefficients,
    resolve_coefficients,
)

# Published by the Polar Express authors (NoahAmsel/PolarExpress, polar_express.py) for l=1e-3,
# safety_factor_eps=1e-2, cushion=0.02, 8 iterations; reproduced in pytorch_optimizer's Muon presets.
PUBLISHED_8_STEPS = [
    (8.237312490495555, -23.157747414558198, 16.680568411445915),
    (4.082441999064835, -2.893047735332586, 0.5252849256975648),
    (3.9263479922546582, -2.8547468034765298, 0.5318022422894988),
    (3.2982187133085143, -2.424541981026706, 0.48632008358844075),
    (2.2970369434552573, -1.63662558125903, 0.4002628455953627),
    (1.8763805351440397, -1.2347896577722228, 0.35891887501668385),
    (1.8564423485617974, -1.2132449880935525, 0.3568003487825883),
    (1.8749994008682747, -1.2499988017229169, 0.3749994008546422),
]

# modded-nanogpt's train_gpt.py (also nanochat): 5 iterations, safety_factor 2e-2, l=1e-3, cushion 0.02.
PUBLISHED_5_STEPS_SAFETY_2E2 = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]

# modded-nanogpt's train_gpt_medium.py.
PUBLISHED_QUINTIC = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]


def quintic(coefficients, x):
    a, b, c = coefficients
    return a * x + b * x**3 + c * x**5


def assert_triples_close(actual, expected, rtol):
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert got == pytest.approx(want, rel=rtol, abs=0)


def test_reproduces_published_polar_express_8_steps():
    ours = polar_express_coefficients(8)
    # The first seven triples come from Remez on intervals at least 5e-3 wide, where the 4x4 system's condition
    # (~1/width^3 <= 1e7) leaves ~1e-9 of float64 noise: two correct solvers agree to that.
    assert_triples_close(ours[:7], PUBLISHED_8_STEPS[:7], rtol=1e-9)
    # The last interval is 9e-6 wide; the reference solved it by Remez too, with a condition number ~1e15,
    # and its triple carries noise of 1.6e-6 (it equals the exact limit h(x/s) with s-1 = 3.2e-7 instead of
    # s = 1). Ours is the limit polynomial at the interval's midpoint, 1 (here 15/8, -10/8, 3/8).
    assert_triples_close(ours[7:], PUBLISHED_8_STEPS[7:], rtol=2e-6)
    assert_triples_close(ours[7:], [(15 / 8, -10 / 8, 3 / 8)], rtol=1e-12)


def test_reproduces_modded_nanogpt_5_step_schedule():
    # All five intervals are wider than 1e-3 (the last step is the undeflated one): same 1e-9 argument as above.
    ours = polar_express_coefficients(5, l=1e-3, safety_eps=2e-2, cushion=0.02)
    assert_triples_close(ours, PUBLISHED_5_STEPS_SAFETY_2E2, rtol=1e-9)


def test_matches_high_precision_remez():
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50

    def remez_50_digits(lower):
        q, r = lower + (1 - lower) / 4, lower + 3 * (1 - lower) / 4
        for _ in range(40):
            rows = [[x, x**3, x**5, (-1) ** i] for i, x in enumerate((lower, q, r, mpmath.mpf(1)))]
            a, b, c, _ = mpmath.lu_solve(mpmath.matrix(rows), mpmath.matrix([1, 1, 1, 1]))
            root = mpmath.sqrt(9 * b * b - 20 * a * c)
            q, r = mpmath.sqrt((-3 * b - root) / (10 * c)), mpmath.sqrt((-3 * b + root) / (10 * c))
        return [float(a), float(b), float(c)]

    # One undeflated, uncushioned step is exactly the minimax quintic on [l, 1]. Widths span the float64 Remez
    # range and the narrow-interval limit (width < 1e-4): float64 Remez at width 1e-3 has conditioning noise
    # ~1e-16/1e-9 = 1e-7 at worst, and the limit polynomial is off by O(width^2) = 1e-8 at width 1e-4. Widths up to
    # 1 - 1e-12 (cushion=0 with a tiny l): there Remez needs its every round to converge, each moving a, b, c by more.
    for width in (1 - 1e-12, 1 - 1e-6, 0.999, 0.9, 0.5, 0.1, 1e-2, 1e-3, 2e-4, 1e-4, 3e-5):
        lower = 1 - width
        expected = remez_50_digits(mpmath.mpf(1) - mpmath.mpf(width))
        (ours,) = polar_express_coefficients(1, l=lower, safety_eps=0.0, cushion=0.0)
        assert_triples_close([ours], [tuple(expected)], rtol=1e-7)


def test_composition_maps_interval_into_shrinking_band():
    l = 1e-3
    schedule = polar_express_coefficients(8, l=l)
    x = np.concatenate([np.geomspace(l, 1.0, 20_000), np.linspace(l, 1.0, 20_000)])
    lower = l
    previous_band = math.inf
    for triple in schedule:
        x = quintic(triple, x)
        lower = quintic(triple, lower)
        band = np.abs(x - 1).max()
        # The design's promise: every value lies in [p(l_k), 2 - p(l_k)], and that band tightens each step.
        assert x.min() >= lower - 1e-15 and x.max() <= 2 - lower + 1e-15
        assert band < previous_band
        previous_band = band
    assert previous_band < 1e-6


@pytest.mark.parametrize("l", [1e-3, 1e-2, 0.3])
def test_each_step_equioscillates_without_safety_or_cushion(l):
    lower, upper = l, 1.0
    for triple in polar_express_coefficients(6, l=l, safety_eps=0.0, cushion=0.0):
        a, b, c = triple
        # Interior extrema of p: roots of p'(x) = a + 3b x^2 + 5c x^4, found independently by numpy.
        roots = np.roots([5 * c, 0, 3 * b, 0, a])
        interior = sorted(r.real for r in roots if abs(r.imag) < 1e-12 and lower < r.real < upper)
        errors = [1 - quintic(triple, x) for x in (lower, *interior, upper)]
        level = abs(errors[0])
        if level < 1e-12:  # below float64 resolution of p - 1 there is nothing left to equioscillate
            break
        assert len(interior) == 2
        # Equal magnitude, alternating sign: the Chebyshev equioscillation condition for a best approximation
        # with three free coefficients. p - 1 is evaluated from O(1) terms, so allow 1e-15 absolute.
        for i, error in enumerate(errors):
            assert error * (-1) ** i > 0
            assert abs(abs(error) - level) <= 1e-9 * level + 1e-15
        # ... and these four points are where the error is largest on the whole interval.
        grid = np.linspace(lower, upper, 50_001)
        assert np.abs(1 - quintic(triple, grid)).max() <= level * (1 + 1e-9) + 1e-15
        lower = quintic(triple, lower)
        upper = 2 - lower


def test_safety_factor_deflates_all_but_the_last_step():
    eps = 0.05
    plain = polar_express_coefficients(3, safety_eps=0.0)
    safe = polar_express_coefficients(3, safety_eps=eps)
    a, b, c = plain[0]  # the first step sees the same interval either way
    assert safe[0] == pytest.approx((a / (1 + eps), b / (1 + eps) ** 3, c / (1 + eps) ** 5), rel=1e-14)
    # A one-step schedule's only step is the last: no deflation.
    assert polar_express_coefficients(1, safety_eps=eps) == polar_express_coefficients(1, safety_eps=0.0)


def test_cushioned_step_is_centred_on_one():
    l = 1e-3
    (triple,) = polar_express_coefficients(1, l=l, safety_eps=0.0, cushion=0.1)
    assert quintic(triple, l) + quintic(triple, 1.0) == pytest.approx(2.0, rel=1e-14)


def test_results_are_cached_but_not_shared():
    first = polar_express_coefficients(8)
    first[0] = (0.0, 0.0, 0.0)
    assert polar_express_coefficients(8)[0] == pytest.approx(PUBLISHED_8_STEPS[0], rel=1e-9)


def test_preset_original_is_torch_muon_default():
    default = (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C)
    assert resolve_coefficients("original", 5) == [default] * 5


def test_preset_quintic_repeats_its_last_step():
    assert resolve_coefficients("quintic", 5) == PUBLISHED_QUINTIC
    assert resolve_coefficients("quintic", 7) == PUBLISHED_QUINTIC + [PUBLISHED_QUINTIC[-1]] * 2
    assert resolve_coefficients("quintic", 2) == PUBLISHED_QUINTIC[:2]


@pytest.mark.parametrize("steps", [1, 5, 8])
def test_preset_polar_express_is_built_for_the_step_count(steps):
    assert resolve_coefficients("polar_express", steps) == polar_express_coefficients(steps)


# modded-nanogpt's train_gpt.py schedule "with safety 2e-2", which timm ships as "polar_express_safer".
PUBLISHED_SAFER_8_STEPS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.0429299351667245, -2.808917465908704, 0.5000178451051299),
    (3.8916678022926563, -2.7724841532176825, 0.5060648178503389),
    (3.285753657755658, -2.3681294933425394, 0.46449024233003117),
    (2.3005307116270983, -1.6111665557258408, 0.3833374427545273),
    (1.8631210546382593, -1.2042160621002727, 0.3421879560523383),
    (1.8382572152247512, -1.1779263289537742, 0.3396513038637379),
    (1.8749999923301852, -1.2499999836060613, 0.374999991275876),
]


def test_preset_polar_express_safer_is_the_published_schedule_with_twice_the_margin():
    ours = resolve_coefficients("polar_express_safer", 8)
    for mine, published in zip(ours, PUBLISHED_SAFER_8_STEPS, strict=True):
        assert mine == pytest.approx(published, rel=1e-7)


def test_presets_are_listed():
    assert COEFFICIENT_PRESETS == ("original", "quintic", "polar_express", "polar_express_safer")
    for name in COEFFICIENT_PRESETS:
        assert resolve_coefficients(name, 0) == []


def test_user_schedule_is_validated_converted_and_repeated():
    schedule = [(3, -4.5, 2), [2.5, -2.0, 0.5]]
    assert resolve_coefficients(schedule, 4) == [(3.0, -4.5, 2.0), (2.5, -2.0, 0.5), (2.5, -2.0, 0.5),
                                                 (2.5, -2.0, 0.5)]
    assert all(isinstance(v, float) for triple in resolve_coefficients(schedule, 2) for v in triple)


def test_a_flat_triple_is_one_triple_for_every_step():
    # torch.optim.Muon's ns_coefficients is one flat (a, b, c).
    triple = (3.4445, -4.7750, 2.0315)
    assert resolve_coefficients(triple, 5) == resolve_coefficients([triple], 5) == [triple] * 5


@pytest.mark.parametrize("spec, fragment", [
    ("cubic", "original, quintic, polar_express"),
    ([], "non-empty"),
    ((3.4445, -4.7750, float("nan")), "finite"),
    ([(1.0, 2.0)], "coefficients[0]"),
    ([(1.0, 2.0, 3.0), (1.0, 2.0, 3.0, 4.0)], "coefficients[1]"),
    ([(1.0, float("nan"), 3.0)], "finite"),
    ([(1.0, float("inf"), 3.0)], "finite"),
    ([(1.0, "2", 3.0)], "finite"),
    ([(1.0, True, 3.0)], "finite"),
    ([("abc")], "coefficients[0]"),
    (None, "Invalid coefficients"),
])
def test_bad_coefficients_are_rejected(spec, fragment):
    with pytest.raises(ValueError, match="Invalid coefficients") as info:
        resolve_coefficients(spec, 5)
    assert fragment in str(info.value)


@pytest.mark.parametrize("steps", [-1, 2.0, True, None])
def test_bad_steps_are_rejected(steps):
    with pytest.raises(ValueError, match="steps"):
        resolve_coefficients("original", steps)


@pytest.mark.parametrize("name, kwargs", [
    ("num_iters", {"num_iters": 0}),
    ("num_iters", {"num_iters": 2.5}),
    ("num_iters", {"num_iters": True}),
    ("l", {"l": 0.0}),
    ("l", {"l": -1e-3}),
    ("l", {"l": 1.5}),
    ("l", {"l": float("nan")}),
    ("safety_eps", {"safety_eps": -0.01}),
    ("safety_eps", {"safety_eps": float("inf")}),
    ("cushion", {"cushion": -0.1}),
    ("cushion", {"cushion": 1.0}),
])
def test_bad_polar_express_arguments_are_rejected(name, kwargs):
    arguments = {"num_iters": 5, **kwargs}
    with pytest.raises(ValueError, match=f"Invalid {name}: {arguments[name]!r}"):
        polar_express_coefficients(**arguments)


@pytest.mark.parametrize("l", [1e-12, 1e-6, 0.5, 0.9999, 1.0])
@pytest.mark.parametrize("cushion", [0.0, 0.02, 0.3])
def test_converges_across_the_parameter_range(l, cushion):
    # Long schedules drive the interval to width 0, through every Remez regime and into the narrow limit.
    schedule = polar_express_coefficients(30, l=l, safety_eps=1e-2, cushion=cushion)
    assert len(schedule) == 30 and all(math.isfinite(v) for triple in schedule for v in triple)
    lower = l
    for triple in schedule:
        lower = quintic(triple, lower)
    assert lower == pytest.approx(1.0, abs=1e-3)
