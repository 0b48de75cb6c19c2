"""The ops on state kept in fewer bytes, on both paths. `native.muon_momentum_rounded_`: the update against float64
torch.lerp of the stored values, the stored momentum against its two representable neighbours, the compiled kernel
against the tensor-op composition it fuses, a shard against the whole tensor, argument checks. `native.load_moment`
and `native.store_moment_` (AdamW's moments): the compiled kernels bit for bit against the tensor ops, whose rounding
tests/test_state_precision.py checks against float64 truths."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_under_test import compiled_ops, load_cpu_variant, load_fallback_variant, submodule
from test_native_ops import path  # noqa: F401 (the fixture: compiled and fallback, per device)

state_precision = submodule(load_fallback_variant(), "state_precision")
EntryPositions = state_precision.EntryPositions
BLOCK = state_precision.BLOCK
# A partial last block, whole blocks, and a last dim shorter than one block; 3-dim for lines of lines.
SHAPES = ((5, 2 * BLOCK + 37), (33, BLOCK), (70, 17), (2, 3, BLOCK + 1))
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _state(form: str, shape: tuple, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A stored momentum of `form` ("bfloat16" or "int8") holding random values, and its scales."""
    values = torch.randn(shape, generator=generator)
    if form == "bfloat16":
        return values.to(torch.bfloat16), None
    codes = torch.empty(shape, dtype=torch.int8)
    scales = torch.empty(state_precision.scales_shape(shape))
    state_precision.store_(["momentum_buffer"], [codes], [scales], [values], [torch.tensor(0)], torch.ones(1), [None])
    return codes, scales


def _inputs(form: str, shape: tuple, grad_dtype: torch.dtype, device: str, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    buffer, scales = _state(form, shape, generator)
    grad = (3 * torch.randn(shape, generator=generator, dtype=torch.float64)).to(grad_dtype)
    return {"buffer": buffer.to(device), "scales": None if scales is None else scales.to(device),
            "grad": grad.to(device), "count": torch.tensor(seed * 7 + 1, device=device)}


def _step(native, inputs: dict, update_dtype: torch.dtype, beta: float, nesterov: bool,
          positions: EntryPositions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    update = torch.full(inputs["grad"].shape, 7.0, dtype=update_dtype, device=inputs["grad"].device)
    finite = native.muon_momentum_rounded_([inputs["buffer"]], [inputs["scales"]], [inputs["grad"]], [update],
                                           [inputs["count"]], [positions], beta, nesterov)
    return update, finite


def _cpu_scales(inputs: dict) -> torch.Tensor | None:
    return None if inputs["scales"] is None else inputs["scales"].cpu()


def _values(inputs: dict) -> torch.Tensor:
    return state_precision.working_copy("momentum_buffer", inputs["buffer"].cpu(), _cpu_scales(inputs)).double()


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("form", ["bfloat16", "int8"])
def test_update_and_stored_momentum_against_float64(path, form: str, grad_dtype: torch.dtype, nesterov: bool) -> None:
    native, device = path
    for seed, shape in enumerate(SHAPES):
        for beta in (0.95, 0.3):  # 0.3 takes torch.lerp's other branch
            inputs = _inputs(form, shape, grad_dtype, device, seed)
            before = _values(inputs)
            grad = inputs["grad"].cpu().float().double()  # the op reads the gradient as float32
            update, finite = _step(native, inputs, torch.float32, beta, nesterov)
            assert finite.tolist() == [1.0]
            momentum = torch.lerp(before, grad, 1 - beta)
            expected_update = torch.lerp(grad, momentum, beta) if nesterov else momentum
            # float32 arithmetic: a few unit roundoffs of the operands' magnitude.
            bound = 4 * 2.0 ** -24 * (before.abs() + grad.abs() + momentum.abs())
            assert ((update.cpu().double() - expected_update).abs() <= bound).all()
            spacing = _spacing(form, momentum, _cpu_scales(inputs))
            assert ((_values(inputs) - momentum).abs() <= spacing + bound).all()


def test_int8_scale_is_each_blocks_largest_over_127(path) -> None:
    native, device = path
    shape = SHAPES[0]
    inputs = _inputs("int8", shape, torch.float32, device, 3)
    update, _ = _step(native, inputs, torch.float32, 0.9, False)  # without Nesterov, the float32 momentum
    lines = torch.nn.functional.pad(update.cpu().abs(), (0, -shape[-1] % BLOCK))
    largest = lines.reshape(*lines.shape[:-1], -1, BLOCK).amax(-1)
    assert torch.equal(inputs["scales"].cpu(), largest / 127)
    assert inputs["buffer"].abs().amax().item() == 127


def _spacing(form: str, momentum: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """The distance between the two stored values around each float32 momentum value."""
    if form == "bfloat16":
        return 2.0 ** (torch.floor(torch.log2(momentum.abs())) - 7)
    return scales.double().repeat_interleave(BLOCK, -1)[..., :momentum.shape[-1]]


@pytest.mark.parametrize("form", ["bfloat16", "int8"])
def test_rounding_is_unbiased_across_counts(path, form: str) -> None:
    # The same step taken under 64 rounding counts: each entry lands on one of its two neighbours, on average on the
    # float32 momentum itself. In units of the spacing each error lies in (-1, 1) with mean 0 and variance <= 1/4,
    # so the mean of n of them is within 5 standard errors, 2.5 / sqrt(n), of 0.
    native, device = path
    shape, counts = (16, BLOCK), 64
    errors = []
    for count in range(counts):
        inputs = _inputs(form, shape, torch.float32, device, 0)
        inputs["count"].fill_(count)
        momentum, _ = _step(native, inputs, torch.float32, 0.9, False)
        momentum = momentum.cpu().double()
        spacing = _spacing(form, momentum, _cpu_scales(inputs))
        error = (_values(inputs) - momentum) / spacing
        assert (error.abs() < 1).all()
        errors.append(error)
    errors = torch.stack(errors)
    assert errors.mean().abs().item() < 2.5 / math.sqrt(errors.numel())
    assert errors.std().item() > 0.1  # the roundings really differ between entries and counts


@compiled_ops
def test_compiled_kernel_matches_the_composition_it_fuses() -> None:
    # The pure-PyTorch path (working copy, torch.lerp, state_precision's rounding) is the specification the CPU kernel
    # implements with the same random bits and float32 operations. Only torch.lerp's and the kernel's choice of fused
    # multiply-adds may differ (a float32 rounding), which moves a stored value by one step only where the momentum
    # sits within that rounding of a threshold.
    compiled, fallback = (submodule(variant, "native") for variant in (load_cpu_variant(), load_fallback_variant()))
    for form in ("bfloat16", "int8"):
        for seed, shape in enumerate(SHAPES):
            for nesterov in (False, True):
                results = []
                for native in (compiled, fallback):
                    inputs = _inputs(form, shape, torch.bfloat16, "cpu", seed)
                    magnitude = _values(inputs).abs() + inputs["grad"].abs().double()  # of every intermediate
                    update, _ = _step(native, inputs, torch.float32, 0.95, nesterov)
                    results.append((inputs, update))
                (inputs, update), (expected, expected_update) = results
                assert ((update - expected_update).abs() <= 2.0 ** -22 * magnitude).all()
                if form == "int8":
                    torch.testing.assert_close(inputs["scales"], expected["scales"], rtol=2.0 ** -22, atol=0)
                    steps = (inputs["buffer"].int() - expected["buffer"].int()).abs()
                else:
                    steps = (inputs["buffer"].view(torch.int16).int() - expected["buffer"].view(torch.int16).int()).abs()
                assert steps.max().item() <= 1 and steps.float().mean().item() < 1e-3, (form, shape, nesterov)


@pytest.mark.parametrize("form, columns", [("bfloat16", slice(0, 300)), ("int8", slice(0, 300)),
                                           ("bfloat16", slice(17, 251))], ids=["rows", "rows-int8", "box"])
def test_a_shard_with_its_positions_stores_what_the_whole_tensor_does(path, form: str, columns: slice) -> None:
    # Rows 3..9 of a (12, 300) tensor (and columns 17..250: rows shorter than a block of random bits), given where
    # they lie in the whole tensor, round exactly as the whole does. int8 blocks lie along whole rows only.
    native, device = path
    whole = _inputs(form, (12, 300), torch.float32, device, 5)
    box = (slice(3, 10), columns)
    shard = {"buffer": whole["buffer"][box].clone(memory_format=torch.contiguous_format),
             "grad": whole["grad"][box].clone(memory_format=torch.contiguous_format),
             "count": whole["count"].clone(), "scales": None if whole["scales"] is None else whole["scales"][3:10].clone()}
    positions = EntryPositions(torch.arange(3, 10, device=device) * 300, torch.arange(300, device=device)[columns])
    _step(native, whole, torch.float32, 0.95, True)
    _step(native, shard, torch.float32, 0.95, True, positions)
    assert torch.equal(shard["buffer"], whole["buffer"][box])
    assert shard["scales"] is None or torch.equal(shard["scales"], whole["scales"][3:10])


@pytest.mark.parametrize("form", ["bfloat16", "int8"])
def test_a_nonfinite_gradient_skips_its_tensor_only(path, form: str) -> None:
    native, device = path
    calls = [_inputs(form, shape, torch.float32, device, seed) for seed, shape in enumerate(SHAPES[:3])]
    calls[1]["grad"].view(-1)[BLOCK + 3] = math.nan
    calls[2]["grad"].view(-1)[-1] = math.inf
    saved = [(inputs["buffer"].clone(), None if inputs["scales"] is None else inputs["scales"].clone())
             for inputs in calls]
    updates = [torch.full(inputs["grad"].shape, 7.0, device=device) for inputs in calls]
    finite = native.muon_momentum_rounded_([c["buffer"] for c in calls], [c["scales"] for c in calls],
                                           [c["grad"] for c in calls], updates, [c["count"] for c in calls],
                                           [None] * 3, 0.95, False)
    assert finite.tolist() == [1.0, 0.0, 0.0]
    assert not torch.equal(calls[0]["buffer"], saved[0][0])
    for inputs, (buffer, scales), update in list(zip(calls, saved, updates))[1:]:
        assert torch.equal(inputs["buffer"], buffer)
        assert scales is None or torch.equal(inputs["scales"], scales)
        assert torch.equal(update, torch.zeros_like(update))


def _bad_calls() -> list[tuple[str, dict, str]]:
    codes = torch.zeros(2, BLOCK + 1, dtype=torch.int8)
    good = {"buffers": [codes], "scales": [torch.zeros(2, 2)], "grads": [torch.zeros(2, BLOCK + 1)],
            "updates": [torch.zeros(2, BLOCK + 1)], "counts": [torch.tensor(0)], "rows": [None], "columns": [None]}
    rows, columns = torch.arange(2) * (BLOCK + 1), torch.arange(BLOCK + 1)
    return [
        ("float32 buffer", good | {"buffers": [torch.zeros(2, BLOCK + 1)]}, r"momentum_buffers\[0\] has dtype"),
        ("scales missing", good | {"scales": [None]}, r"scales\[0\] must be given"),
        ("scales for bf16", good | {"buffers": [codes.bfloat16()]}, r"scales\[0\] must be None"),
        ("scales shape", good | {"scales": [torch.zeros(2, 1)]}, r"scales\[0\] must be a contiguous float32"),
        ("count dtype", good | {"counts": [torch.tensor(0.0)]}, r"rounding_counts\[0\] must be one int64"),
        ("positions dtype", good | {"rows": [rows.int()], "columns": [columns]},
         r"row_positions\[0\] must be a contiguous 1D int64"),
        ("columns alone", good | {"columns": [columns]},
         r"row_positions\[0\] and column_positions\[0\] must be given together"),
        ("positions too few", good | {"rows": [rows[:1]], "columns": [columns]}, r"do not cover entries 0 to 514"),
        ("grad shape", good | {"grads": [torch.zeros(2, BLOCK)]}, r"grads\[0\] has shape"),
        ("list lengths", good | {"counts": []}, "scales, rounding_counts, row_positions and column_positions have"),
    ]


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda case: case[0])
@compiled_ops
def test_compiled_op_rejects_bad_arguments_naming_them(case) -> None:
    _, arguments, message = case
    ops = submodule(load_cpu_variant(), "_ops").ops
    with pytest.raises(ValueError, match=message):
        ops.muon_momentum_rounded_(arguments["buffers"], arguments["scales"], arguments["grads"],
                                   arguments["updates"], torch.zeros(1), arguments["counts"], arguments["rows"],
                                   arguments["columns"], 0.9, False)


def test_compiled_op_really_runs(path) -> None:
    native, device = path
    inputs = _inputs("int8", (2, 8), torch.float32, device, 0)
    with torch.profiler.profile() as profile:
        _step(native, inputs, torch.float32, 0.9, False)
    ran_compiled = any(event.name.endswith("::muon_momentum_rounded_") for event in profile.events())
    assert ran_compiled == native.ops_summary().startswith("compiled ops")


MOMENT_CODES = (("exp_avg", "bfloat16"), ("momentum_buffer", "int8"), ("exp_avg", "int8"), ("exp_avg_sq", "int8"))


def _moment(key: str, form: str, shape: tuple, seed: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A stored moment, its scales, and new float32 values for it (a second moment's are squares)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator) * torch.logspace(-6, 2, shape[-1])  # many magnitudes per block
    if key == "exp_avg_sq":
        values = values.square()
    if form == "bfloat16":
        return torch.randn(shape, generator=generator).bfloat16(), None, values
    codes = torch.randint(-128, 128, shape, generator=generator, dtype=torch.int8)
    if key != "momentum_buffer":  # e4m3 codes: every byte but the NaNs (0x7F, 0xFF)
        codes = torch.where((codes == 127) | (codes == -1), 0, codes).to(torch.int8)
    else:
        codes = codes.clamp(-127, 127)
    return codes, torch.rand(state_precision.scales_shape(shape), generator=generator), values


@pytest.mark.parametrize("key, form", MOMENT_CODES)
@compiled_ops
def test_compiled_moment_ops_match_the_tensor_ops_bit_for_bit(key: str, form: str) -> None:
    compiled, fallback = (submodule(variant, "native") for variant in (load_cpu_variant(), load_fallback_variant()))
    for seed, shape in enumerate(SHAPES):
        stored, scales, values = _moment(key, form, shape, seed)
        loaded = [native.load_moment(key, stored, scales) for native in (compiled, fallback)]
        assert torch.equal(loaded[0], loaded[1]), (key, form, shape)
        # A shard's positions with 7 columns (a block's bits drawn from several rows) and room for a chunk at 1000.
        generator = torch.Generator().manual_seed(seed)
        shard = EntryPositions(torch.randint(0, 2 ** 40, ((values.numel() + 1000) // 7 + 1,), generator=generator),
                               torch.randint(0, 2 ** 20, (7,), generator=generator))
        for positions, offset in ((None, 0), (None, 1000), (shard, 0), (shard, 1000)):
            for taken in (1.0, 0.0):
                results = []
                for native in (compiled, fallback):
                    out, out_scales = stored.clone(), None if scales is None else scales.clone()
                    native.store_moment_(key, out, out_scales, values, torch.tensor(seed + 3), torch.tensor(taken),
                                         positions, offset)
                    results.append((out, out_scales))
                (out, out_scales), (expected, expected_scales) = results
                assert torch.equal(out, expected), (key, form, shape, offset, taken)
                assert scales is None or torch.equal(out_scales, expected_scales)
                if taken == 0.0:
                    assert torch.equal(out, stored)


@pytest.mark.parametrize("key", ["momentum_buffer", "exp_avg", "exp_avg_sq"])
def test_an_infinite_entry_leaves_its_blocks_finite(path, key: str) -> None:
    # A second moment whose square overflowed float32 (a gradient entry of 1e20 is finite): its block's scale was
    # infinite, and every other entry of the block loaded as 0 * inf = NaN, then the parameters' next update.
    native, device = path
    values = torch.full((2, BLOCK), 1e-3, device=device)
    values[0, 5] = math.inf
    stored = torch.zeros(values.shape, dtype=torch.int8, device=device)
    scales = torch.zeros(state_precision.scales_shape(values.shape), device=device)
    native.store_moment_(key, stored, scales, values, torch.tensor(5, device=device), torch.tensor(1.0, device=device),
                         None)
    loaded = native.load_moment(key, stored, scales).cpu()
    assert torch.isfinite(scales).all() and not torch.isnan(loaded).any()
    assert loaded[0, 5] >= 0.99 * torch.finfo(torch.float32).max  # the largest code at the largest finite scale
    assert torch.allclose(loaded[1].double(), values[1].cpu().double(), rtol=0.13)  # the other block as it was


@pytest.mark.parametrize("key", ["momentum_buffer", "exp_avg", "exp_avg_sq"])
def test_an_all_zero_block_stores_and_loads_as_zeros(path, key: str) -> None:
    # A moment's block with nothing in it yet (an embedding row no token has reached, a fresh state): its scale is 0,
    # and dividing by it made 0 / 0 = NaN codes (e4m3's NaN code loads as NaN at any scale).
    native, device = path
    values = torch.zeros((2, BLOCK), device=device)
    values[1] = torch.linspace(-1.0, 1.0, BLOCK, device=device).abs() if key == "exp_avg_sq" else torch.linspace(
        -1.0, 1.0, BLOCK, device=device)
    stored = torch.ones(values.shape, dtype=torch.int8, device=device)
    scales = torch.ones(state_precision.scales_shape(values.shape), device=device)
    native.store_moment_(key, stored, scales, values, torch.tensor(5, device=device), torch.tensor(1.0, device=device),
                         None)
    loaded = native.load_moment(key, stored, scales).cpu()
    assert torch.equal(loaded[0], torch.zeros(BLOCK)) and torch.equal(scales[0].cpu(), torch.zeros(1))
    assert not torch.isnan(loaded).any()


@pytest.mark.parametrize("key, form", MOMENT_CODES)
def test_a_stored_moment_loads_within_one_step_of_its_values(path, key: str, form: str) -> None:
    native, device = path
    stored, scales, values = _moment(key, form, SHAPES[0], 1)
    stored, values = stored.to(device), values.to(device)
    scales = None if scales is None else scales.to(device)
    native.store_moment_(key, stored, scales, values, torch.tensor(5, device=device),
                         torch.tensor(1.0, device=device), None)
    loaded = native.load_moment(key, stored, scales).cpu().double()
    truth = values.cpu().double()
    if form == "bfloat16":
        assert ((loaded - truth).abs() <= truth.abs() * 2.0 ** -7).all()
    elif key == "momentum_buffer":  # linear codes: within one step of the block's scale
        step = scales.cpu().double().repeat_interleave(BLOCK, -1)[..., :truth.shape[-1]]
        assert ((loaded - truth).abs() <= step * (1 + 1e-6)).all()
    else:  # e4m3 (of the root, for exp_avg_sq): 3 mantissa bits, or a subnormal step of the block's scale
        root = key == "exp_avg_sq"
        coded, decoded = (truth.sqrt(), loaded.sqrt()) if root else (truth, loaded)
        scale = scales.cpu().double().repeat_interleave(BLOCK, -1)[..., :truth.shape[-1]]
        assert ((decoded - coded).abs() <= coded.abs() * 2.0 ** -3 + scale * 2.0 ** -9 + 1e-30).all()
