"""The compiled `normalize_elements_` op (AdaMuon's per-entry second moment and division, in place, in one pass)
against float64 and against the composition of torch ops it replaces, which the package's fallback build runs, and
its refusal of bad arguments before it writes anything."""

from __future__ import annotations

import pytest
import torch
from kernel_under_test import load_cpu_variant, load_fallback_variant, submodule

native = submodule(load_cpu_variant(), "native")
normalization = submodule(load_cpu_variant(), "normalization")
fallback_normalization = submodule(load_fallback_variant(), "normalization")
BETA, EPS = 0.95, 1e-8
UPDATE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# Odd sizes leave a vector tail, and 70001 entries are more than one parallel chunk (grain 32768).
SHAPES = ((7,), (33, 17), (70001,))


def _inputs(update_dtype: torch.dtype, moment_dtype: torch.dtype, seed: int):
    """Updates of orthogonalized size (entries ~1/sqrt(n)), moments of their squares' size, a step count each."""
    generator = torch.Generator().manual_seed(seed)
    updates = [(torch.randn(shape, generator=generator) * 0.05).to(update_dtype) for shape in SHAPES]
    moments = [(torch.randn(shape, generator=generator) * 0.05).square().to(moment_dtype) for shape in SHAPES]
    steps = [torch.tensor(float(step)) for step in (1, 3, 40)]
    return updates, moments, steps


@pytest.mark.parametrize("bias_correction", [True, False], ids=["bias-corrected", "uncorrected"])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("update_dtype", UPDATE_DTYPES, ids=str)
def test_equals_the_composition_it_replaces(update_dtype: torch.dtype, moment_dtype: torch.dtype,
                                            bias_correction: bool) -> None:
    # The same roundings in the same order; the moment's update is one fused multiply-add in both (torch's
    # vectorized foreach add_), but torch's scalar tail may round it separately: allow one unit in the last place of
    # the moment, and for the update (computed in the moment's dtype, then rounded to its own) two more such units
    # (the root halves the moment's, the quotient adds its own rounding) and one of its dtype.
    skipped = torch.tensor([False, True, False])
    results = []
    for module in (normalization, fallback_normalization):
        updates, moments, steps = _inputs(update_dtype, moment_dtype, seed=0)
        updates[1].zero_()  # a skipped parameter's update is all zeros
        out, _ = module.normalize(updates, None, moments, steps, skipped, [None] * 3, "element", BETA, EPS,
                                  bias_correction)
        results.append((out, moments, steps))
    (ours, our_moments, our_steps), (theirs, their_moments, their_steps) = results
    assert [float(step) for step in our_steps] == [float(step) for step in their_steps] == [2.0, 3.0, 41.0]
    for mine, reference in zip(our_moments, their_moments):
        torch.testing.assert_close(mine, reference, rtol=torch.finfo(moment_dtype).eps, atol=0)
    for mine, reference in zip(ours, theirs):
        assert mine.dtype == update_dtype
        torch.testing.assert_close(mine, reference,
                                   rtol=2 * torch.finfo(moment_dtype).eps + torch.finfo(update_dtype).eps, atol=0)


@pytest.mark.parametrize("update_dtype", UPDATE_DTYPES, ids=str)
def test_within_the_update_dtypes_rounding_of_float64(update_dtype: torch.dtype) -> None:
    updates, moments, steps = _inputs(update_dtype, torch.float32, seed=1)
    exact_updates = [update.double() for update in updates]
    exact_moments = [BETA * moment.double() + (1 - BETA) * update.square() for moment, update in
                     zip(moments, exact_updates)]
    corrections = [1 - BETA ** (float(step) + 1) for step in steps]
    exact = [update / ((moment / correction).sqrt() + EPS)
             for update, moment, correction in zip(exact_updates, exact_moments, corrections)]
    out, _ = normalization.normalize(updates, None, moments, steps, torch.zeros(3, dtype=torch.bool), [None] * 3,
                                     "element", BETA, EPS, True)
    for result, expected, moment, exact_moment in zip(out, exact, moments, exact_moments):
        # the update: its own rounding (absolute where it is subnormal) plus a few float32 ones; the moment: a few
        # float32 roundings
        info = torch.finfo(update_dtype)
        torch.testing.assert_close(result.double(), expected, rtol=info.eps + 1e-6,
                                   atol=info.smallest_normal * info.eps)
        torch.testing.assert_close(moment.double(), exact_moment, rtol=1e-6, atol=0)


def test_the_compiled_op_serves_contiguous_cpu_updates() -> None:
    updates, moments, steps = _inputs(torch.bfloat16, torch.float32, seed=2)
    with torch.profiler.profile() as profile:
        out, _ = normalization.normalize(updates, None, moments, steps, torch.zeros(3, dtype=torch.bool),
                                         [None] * 3, "element", BETA, EPS, True)
    assert any(event.name.endswith("::normalize_elements_") for event in profile.events())
    assert all(result is update for result, update in zip(out, updates))  # in place


def test_strided_updates_take_the_composition() -> None:
    updates, moments, steps = _inputs(torch.float32, torch.float32, seed=3)
    transposed = [torch.randn(17, 33).t()]
    with torch.profiler.profile() as profile:
        normalization.normalize(transposed, None, [moments[1]], [steps[1]], torch.zeros(1, dtype=torch.bool),
                                [None], "element", BETA, EPS, True)
    assert not any(event.name.endswith("::normalize_elements_") for event in profile.events())


def test_bad_arguments_are_refused_before_anything_is_written() -> None:
    op = native.ops.normalize_elements_
    factors = torch.ones(1, dtype=torch.float64)
    update, moment = torch.ones(4, 3), torch.ones(4, 3)
    cases = [
        ("moments count", ([update], [moment, moment], factors, factors), "moments has 2 tensors"),
        ("decays dtype", ([update], [moment], torch.ones(1), factors), "decays must be a contiguous float64"),
        ("corrections count", ([update], [moment], factors, torch.ones(2, dtype=torch.float64)), "corrections must"),
        ("strided update", ([torch.ones(3, 4).t()], [moment], factors, factors), r"updates\[0\] must be contiguous"),
        ("moment dtype", ([update], [moment.bfloat16()], factors, factors), r"moments\[0\] has dtype"),
        ("shape", ([update], [torch.ones(12)], factors, factors), r"moments\[0\] has shape"),
        ("aliased", ([update], [update], factors, factors), "shares memory"),
    ]
    for name, args, message in cases:
        before = [tensor.clone() for tensor in (*args[0], *args[1])]
        with pytest.raises(ValueError, match=message):
            op(*args, 0.05, EPS)
        assert all(torch.equal(tensor, saved) for tensor, saved in zip((*args[0], *args[1]), before)), name
