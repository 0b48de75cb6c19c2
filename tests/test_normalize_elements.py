"""The compiled `normalize_elements_` op (AdaMuon's per-entry second moment and division, in place, in one pass, with
the result's sum of squares) against float64 and against the composition of torch ops it replaces, which the
package's fallback build runs; the layouts it serves; and its refusal of bad arguments before it writes anything."""

from __future__ import annotations

import pytest
import torch
from kernel_under_test import compiled_ops, load_cpu_variant, load_fallback_variant, submodule

pytestmark = compiled_ops

native = submodule(load_cpu_variant(), "native")
normalization = submodule(load_cpu_variant(), "normalization")
fallback_normalization = submodule(load_fallback_variant(), "normalization")
BETA, EPS = 0.95, 1e-8
UPDATE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# Odd sizes leave a vector tail, and 70001 entries are more than one parallel chunk (grain 32768). Stored transposed,
# the matrices are read in 64 x 64 tiles: 33 x 17 is one partial tile, a stack of three 130 x 70 matrices has partial
# tiles at both edges of each, and 300 x 200 holds 20 tiles, more than one parallel task's (8).
SHAPES = ((7,), (33, 17), (70001,), (3, 130, 70), (300, 200))
STEPS = (1, 3, 40, 7, 2)


def _inputs(update_dtype: torch.dtype, moment_dtype: torch.dtype, seed: int, transposed: bool = False):
    """Updates of orthogonalized size (entries ~1/sqrt(n)), matrices laid out straight or as the transpose of a
    contiguous tensor (a tall matrix's Newton-Schulz result), moments of their squares' size, a step count each."""
    generator = torch.Generator().manual_seed(seed)
    updates = []
    for shape in SHAPES:
        values = torch.randn(shape, generator=generator) * 0.05
        updates.append((values.mT.contiguous().mT if transposed and values.ndim >= 2 else values).to(update_dtype))
    moments = [(torch.randn(shape, generator=generator) * 0.05).square().to(moment_dtype) for shape in SHAPES]
    steps = [torch.tensor(float(step)) for step in STEPS]
    return updates, moments, steps


@pytest.mark.parametrize("transposed", [False, True], ids=["straight", "transposed"])
@pytest.mark.parametrize("bias_correction", [True, False], ids=["bias-corrected", "uncorrected"])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("update_dtype", UPDATE_DTYPES, ids=str)
def test_equals_the_composition_it_replaces(update_dtype: torch.dtype, moment_dtype: torch.dtype,
                                            bias_correction: bool, transposed: bool) -> None:
    # The same roundings in the same order; the moment's update is one fused multiply-add in both (torch's
    # vectorized foreach add_), but torch's scalar tail may round it separately: allow one unit in the last place of
    # the moment, and for the update (computed in the moment's dtype, then rounded to its own) two more such units
    # (the root halves the moment's, the quotient adds its own rounding) and one of its dtype.
    skipped = torch.tensor([False, True, False, False, False])
    results = []
    for module in (normalization, fallback_normalization):
        updates, moments, steps = _inputs(update_dtype, moment_dtype, seed=0, transposed=transposed)
        updates[1].zero_()  # a skipped parameter's update is all zeros
        out, _ = module.normalize(updates, None, moments, steps, skipped, [None] * len(SHAPES), "element", BETA, EPS,
                                  bias_correction)
        results.append((out, moments, steps))
    (ours, our_moments, our_steps), (theirs, their_moments, their_steps) = results
    assert [float(step) for step in our_steps] == [float(step) for step in their_steps] == [2.0, 3.0, 41.0, 8.0, 3.0]
    for mine, reference in zip(our_moments, their_moments):
        torch.testing.assert_close(mine, reference, rtol=torch.finfo(moment_dtype).eps, atol=0)
    for mine, reference in zip(ours, theirs):
        assert mine.dtype == update_dtype
        torch.testing.assert_close(mine, reference,
                                   rtol=2 * torch.finfo(moment_dtype).eps + torch.finfo(update_dtype).eps, atol=0)


@pytest.mark.parametrize("transposed", [False, True], ids=["straight", "transposed"])
@pytest.mark.parametrize("update_dtype", UPDATE_DTYPES, ids=str)
def test_within_the_update_dtypes_rounding_of_float64(update_dtype: torch.dtype, transposed: bool) -> None:
    updates, moments, steps = _inputs(update_dtype, torch.float32, seed=1, transposed=transposed)
    exact_updates = [update.double() for update in updates]
    exact_moments = [BETA * moment.double() + (1 - BETA) * update.square() for moment, update in
                     zip(moments, exact_updates)]
    corrections = [1 - BETA ** (float(step) + 1) for step in steps]
    exact = [update / ((moment / correction).sqrt() + EPS)
             for update, moment, correction in zip(exact_updates, exact_moments, corrections)]
    out, totals = normalization.normalize(updates, None, moments, steps, torch.zeros(len(SHAPES), dtype=torch.bool),
                                          [None] * len(SHAPES), "element", BETA, EPS, True, sums_of_squares=True)
    assert all(result is update for result, update in zip(out, updates))  # in place, in its own layout
    for result, expected, moment, exact_moment in zip(out, exact, moments, exact_moments):
        # the update: its own rounding (absolute where it is subnormal) plus a few float32 ones; the moment: a few
        # float32 roundings
        info = torch.finfo(update_dtype)
        torch.testing.assert_close(result.double(), expected, rtol=info.eps + 1e-6,
                                   atol=info.smallest_normal * info.eps)
        torch.testing.assert_close(moment.double(), exact_moment, rtol=1e-6, atol=0)
    # the sums of squares are of the stored results: each lane adds 16 squares in the moment's dtype (float32 here),
    # then the lanes' sums go into one float64 total
    exact_totals = torch.stack([result.double().square().sum() for result in out])
    torch.testing.assert_close(totals, exact_totals, rtol=16 * torch.finfo(torch.float32).eps, atol=0)


@pytest.mark.parametrize("transposed", [False, True], ids=["straight", "transposed"])
def test_the_compiled_op_serves_cpu_updates_straight_or_transposed(transposed: bool) -> None:
    updates, moments, steps = _inputs(torch.bfloat16, torch.float32, seed=2, transposed=transposed)
    with torch.profiler.profile() as profile:
        out, _ = normalization.normalize(updates, None, moments, steps, torch.zeros(len(SHAPES), dtype=torch.bool),
                                         [None] * len(SHAPES), "element", BETA, EPS, True)
    assert any(event.name.endswith("::normalize_elements_") for event in profile.events())
    assert all(result is update for result, update in zip(out, updates))  # in place


def test_strided_updates_take_the_composition() -> None:
    updates, moments, steps = _inputs(torch.float32, torch.float32, seed=3)
    strided = [torch.randn(33, 34)[:, ::2]]
    with torch.profiler.profile() as profile:
        _, totals = normalization.normalize(strided, None, [moments[1]], [steps[1]], torch.zeros(1, dtype=torch.bool),
                                            [None], "element", BETA, EPS, True, sums_of_squares=True)
    assert not any(event.name.endswith("::normalize_elements_") for event in profile.events())
    # float64 as the compiled op's: a distributed step's ranks, whose shards may take either pass, add them up
    assert totals.dtype == torch.float64


def test_bad_arguments_are_refused_before_anything_is_written() -> None:
    op = native.ops.normalize_elements_
    factors = torch.ones(1, dtype=torch.float64)
    update, moment = torch.ones(4, 3), torch.ones(4, 3)
    cases = [
        ("moments count", ([update], [moment, moment], factors, factors, factors), "moments has 2 tensors"),
        ("decays dtype", ([update], [moment], torch.ones(1), factors, factors), "decays must be a contiguous float64"),
        ("corrections count", ([update], [moment], factors, torch.ones(2, dtype=torch.float64), factors),
         "corrections must"),
        ("squares count", ([update], [moment], factors, factors, torch.ones(2, dtype=torch.float64)), "squares must"),
        ("strided update", ([torch.ones(4, 6)[:, ::2]], [moment], factors, factors, factors),
         r"updates\[0\] must be contiguous or the transpose"),
        ("transposed moment", ([update], [torch.ones(3, 4).t()], factors, factors, factors),
         r"moments\[0\] must be contiguous"),
        ("moment dtype", ([update], [moment.bfloat16()], factors, factors, factors), r"moments\[0\] has dtype"),
        ("shape", ([update], [torch.ones(12)], factors, factors, factors), r"moments\[0\] has shape"),
        ("aliased", ([update], [update], factors, factors, factors), "shares memory"),
    ]
    for name, args, message in cases:
        before = [tensor.clone() for tensor in (*args[0], *args[1])]
        with pytest.raises(ValueError, match=message):
            op(args[0], args[1], args[2], args[3], 0.05, EPS, args[4])
        assert all(torch.equal(tensor, saved) for tensor, saved in zip((*args[0], *args[1]), before)), name
