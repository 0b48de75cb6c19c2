"""The compiled `normalize_rows_` op (NorMuon's per-row second moment and division, in place, with the result's sum
of squares) against float64 and against the composition of torch ops it replaces, which the package's fallback build
runs; the layouts it serves; and its refusal of bad arguments before it writes anything."""

from __future__ import annotations

import pytest
import torch
from kernel_under_test import compiled_ops, load_cpu_variant, load_fallback_variant, optimizer, submodule

pytestmark = compiled_ops

native = submodule(load_cpu_variant(), "native")
normalization = submodule(load_cpu_variant(), "normalization")
routing = submodule(load_cpu_variant(), "routing")
fallback_normalization = submodule(load_fallback_variant(), "normalization")
BETA, EPS = 0.95, 1e-8
UPDATE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# Odd sizes leave vector tails; 300 x 120 holds more than one parallel task's rows (grain 32768 entries); a stack of
# experts; a tall one stored transposed whose tasks (at least 256 rows) cross from one matrix into the next.
SHAPES = ((7, 5), (33, 17), (300, 120), (3, 40, 29), (3, 700, 60))


def _inputs(update_dtype: torch.dtype, moment_dtype: torch.dtype, transposed: bool, seed: int):
    """Updates of orthogonalized size (entries ~1/sqrt(n)), laid out straight or as the transpose of a contiguous
    tensor, per-row moments of their mean squares' size, a step count each."""
    generator = torch.Generator().manual_seed(seed)
    updates = []
    for shape in SHAPES:
        values = torch.randn(shape, generator=generator) * 0.05
        updates.append((values.mT.contiguous().mT if transposed else values).to(update_dtype))
    moments = [(torch.randn((*shape[:-1], 1), generator=generator) * 0.05).square().to(moment_dtype)
               for shape in SHAPES]
    steps = [torch.tensor(float(step)) for step in (1, 3, 40, 7, 2)]
    views = [routing.matrix_view(torch.Size(shape)) for shape in SHAPES]
    return updates, moments, steps, views


def _float64_reference(updates, moments, steps, skipped, bias_correction: bool):
    """The normalization in float64 from the inputs as given: moments, normalized updates, sums of squares of the
    updates as rounded to their dtype."""
    results = []
    for update, moment, step, skip in zip(updates, moments, steps, skipped.tolist()):
        exact = update.double()
        decay = 1.0 if skip else BETA
        new_moment = decay * moment.double() + (1 - BETA) * exact.square().mean(dim=-1, keepdim=True)
        correction = 1 - BETA ** (float(step) + (0 if skip else 1)) if bias_correction else 1.0
        results.append((new_moment, exact / ((new_moment / correction).sqrt() + EPS)))
    return results


@pytest.mark.parametrize("transposed", [False, True], ids=["straight", "transposed"])
@pytest.mark.parametrize("bias_correction", [True, False], ids=["bias-corrected", "uncorrected"])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("update_dtype", UPDATE_DTYPES, ids=str)
def test_within_rounding_of_float64(update_dtype: torch.dtype, moment_dtype: torch.dtype, bias_correction: bool,
                                    transposed: bool) -> None:
    updates, moments, steps, views = _inputs(update_dtype, moment_dtype, transposed, seed=0)
    updates[1].zero_()  # a skipped parameter's update is all zeros
    skipped = torch.tensor([False, True, False, False, False])
    expected = _float64_reference(updates, moments, steps, skipped, bias_correction)
    before_skipped = moments[1].clone()
    out, totals = normalization.normalize(updates, None, moments, steps, skipped, views, "neuron", BETA, EPS,
                                          bias_correction, sums_of_squares=True)
    assert all(result is update for result, update in zip(out, updates))  # in place, in its own layout
    assert [float(step) for step in steps] == [2.0, 3.0, 41.0, 8.0, 3.0]
    assert torch.equal(moments[1], before_skipped)
    # the moment: a row sum of up to 120 squares and a few more roundings of its dtype; the update: its own rounding
    # (absolute where it is subnormal) plus those
    moment_rtol = 64 * torch.finfo(moment_dtype).eps
    info = torch.finfo(update_dtype)
    for result, moment, (exact_moment, exact_update) in zip(out, moments, expected):
        torch.testing.assert_close(moment.double(), exact_moment, rtol=moment_rtol, atol=0)
        assert result.dtype == update_dtype
        torch.testing.assert_close(result.double(), exact_update, rtol=info.eps + moment_rtol,
                                   atol=info.smallest_normal * info.eps)
    # the sums of squares are of the stored results, accumulated in float64
    exact_totals = torch.stack([result.double().square().sum() for result in out])
    torch.testing.assert_close(totals, exact_totals, rtol=1e-12, atol=0)


@pytest.mark.parametrize("transposed", [False, True], ids=["straight", "transposed"])
@pytest.mark.parametrize("update_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_near_the_composition_it_replaces(update_dtype: torch.dtype, transposed: bool) -> None:
    # The same roundings but the row sums' order (a float32 sum of up to 120 squares) and the norm's square root and
    # square, which the composition takes from torch.linalg.vector_norm.
    results = []
    for module in (normalization, fallback_normalization):
        updates, moments, steps, views = _inputs(update_dtype, torch.float32, transposed, seed=1)
        out, totals = module.normalize(updates, None, moments, steps, torch.zeros(5, dtype=torch.bool), views,
                                       "neuron", BETA, EPS, True, sums_of_squares=True)
        results.append((out, moments, totals))
    (ours, our_moments, our_totals), (theirs, their_moments, their_totals) = results
    for mine, reference in zip(our_moments, their_moments):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=0)
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine, reference, rtol=torch.finfo(update_dtype).eps + 1e-5, atol=0)
    torch.testing.assert_close(our_totals, their_totals, rtol=1e-5, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("bias_correction", [True, False], ids=["bias-corrected", "uncorrected"])
@pytest.mark.parametrize("update_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_gpus_composition_matches_the_cpus(update_dtype: torch.dtype, bias_correction: bool) -> None:
    """On a GPU `normalize` takes the composition of torch ops (its foreach launches, each update divided in place),
    held to the same composition on the CPU (the fallback build's): a skipped parameter left as it was."""
    results = []
    for device, module in (("cpu", fallback_normalization), ("cuda", submodule(optimizer, "normalization"))):
        updates, moments, steps, views = _inputs(update_dtype, torch.float32, True, seed=4)
        updates, moments, steps = ([tensor.to(device) for tensor in tensors] for tensors in (updates, moments, steps))
        updates[1].zero_()
        skipped = torch.tensor([False, True, False, False, False], device=device)
        out, totals = module.normalize(updates, None, moments, steps, skipped, views, "neuron", BETA, EPS,
                                       bias_correction, sums_of_squares=True)
        assert all(result is update for result, update in zip(out, updates))
        results.append(([tensor.cpu() for tensor in (*out, *moments, *steps)], totals.cpu()))
    (cpu_tensors, cpu_totals), (gpu_tensors, gpu_totals) = results
    # the row sums' order (CUDA's reduction against the CPU's) moves the moments by a few float32 roundings, and an
    # update by those and its own rounding
    moment_rtol = 64 * torch.finfo(torch.float32).eps
    for on_cpu, on_gpu in zip(cpu_tensors, gpu_tensors):
        torch.testing.assert_close(on_gpu, on_cpu, rtol=torch.finfo(on_cpu.dtype).eps + moment_rtol, atol=1e-30)
    torch.testing.assert_close(gpu_totals, cpu_totals, rtol=1e-5, atol=0)


def test_shards_of_rows_and_conv_views_take_the_composition() -> None:
    updates, moments, steps, views = _inputs(torch.float32, torch.float32, False, seed=2)
    row_sums = normalization.row_squares(updates, views, torch.float32)
    conv = torch.randn(6, 3, 2, 2)
    conv_view = routing.matrix_view(conv.shape)
    for args in ((updates, row_sums, moments, steps, torch.zeros(5, dtype=torch.bool), views),
                 ([conv], None, [torch.ones(6, 1, 1, 1)], [steps[0]], torch.zeros(1, dtype=torch.bool), [conv_view])):
        with torch.profiler.profile() as profile:
            normalization.normalize(*args, "neuron", BETA, EPS, True)
        assert not any(event.name.endswith("::normalize_rows_") for event in profile.events())


def test_the_compiled_op_serves_whole_cpu_matrices() -> None:
    updates, moments, steps, views = _inputs(torch.bfloat16, torch.float32, True, seed=3)
    with torch.profiler.profile() as profile:
        normalization.normalize(updates, None, moments, steps, torch.zeros(5, dtype=torch.bool), views, "neuron", BETA,
                                EPS, True)
    assert any(event.name.endswith("::normalize_rows_") for event in profile.events())


def test_bad_arguments_are_refused_before_anything_is_written() -> None:
    op = native.ops.normalize_rows_
    factors = torch.ones(1, dtype=torch.float64)
    update, moment = torch.ones(4, 3), torch.ones(4, 1)
    cases = [
        ("moments count", ([update], [moment, moment], factors, factors, factors), "moments has 2 tensors"),
        ("decays dtype", ([update], [moment], torch.ones(1), factors, factors), "decays must be a contiguous float64"),
        ("squares count", ([update], [moment], factors, factors, torch.ones(2, dtype=torch.float64)),
         "squares must"),
        ("vector", ([torch.ones(4)], [moment], factors, factors, factors), r"updates\[0\] must be \(\.\.\., rows"),
        ("strided update", ([torch.ones(4, 6)[:, ::2]], [moment], factors, factors, factors),
         r"updates\[0\] must be contiguous or the transpose"),
        ("moment dtype", ([update], [moment.bfloat16()], factors, factors, factors), r"moments\[0\] has dtype"),
        ("moment rows", ([update], [torch.ones(3, 1)], factors, factors, factors), r"moments\[0\] has 3 entries"),
        ("aliased", ([update], [update.view(-1)[:4]], factors, factors, factors), "shares memory"),
    ]
    for name, args, message in cases:
        before = [tensor.clone() for tensor in (*args[0], *args[1])]
        with pytest.raises(ValueError, match=message):
            op(args[0], args[1], args[2], args[3], 0.05, EPS, args[4])
        assert all(torch.equal(tensor, saved) for tensor, saved in zip((*args[0], *args[1]), before)), name
