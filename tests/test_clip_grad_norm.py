"""`Muon.clip_grad_norm_` against `torch.nn.utils.clip_grad_norm_`, the `squared_norms_` op against float64 sums,
and the step that takes the clip's finite flags instead of reading the gradients again: the same parameters as after
torch's clip and our own guard, in every case where a gradient is not finite or changed after the clip. Both ways of
reading the gradients once are covered: the compiled CPU op, and torch's per-tensor norms (GPUs, other norms, builds
without the op; here through the build without compiled ops)."""

from __future__ import annotations

import copy
import gc
import math
import weakref

import pytest
import torch
from kernel_under_test import compiled_ops, load_cpu_variant, load_fallback_variant, optimizer, submodule

# The compiled CPU build, also where the package under test is the CUDA variant (a CUDA torch), which has no CPU ops.
cpu_build = load_cpu_variant()
native = submodule(cpu_build, "native")
HAS_CUDA = torch.cuda.is_available()
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 24), torch.nn.LayerNorm(24),
                                torch.nn.Linear(24, 50))
    return model.to(dtype)


def _backward(model: torch.nn.Module, seed: int, *more: torch.nn.Module) -> None:
    """Fresh gradients of a loss on the seed's tokens, for each model given."""
    tokens = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(seed))
    for each in (model, *more):
        each.zero_grad()
        each(tokens).float().square().mean().backward()


@pytest.fixture(params=[pytest.param("squared_norms_ op", marks=compiled_ops), "tensor norms"])
def package(request: pytest.FixtureRequest):
    """The package whose clip reads the gradients the named way: the CPU build's compiled op (L2), or torch's
    per-tensor norms (the build without compiled ops)."""
    return cpu_build if request.param == "squared_norms_ op" else load_fallback_variant()


def _twins(package=cpu_build, **options) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer,
                                                  torch.optim.Optimizer]:
    """A model and its copy, each with its own Muon."""
    model = _model()
    reference = copy.deepcopy(model)
    ours = package.Muon(model.parameters(), lr=0.02, **options)
    theirs = package.Muon(reference.parameters(), lr=0.02, **options)
    return model, reference, ours, theirs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [0, 1, 17, 32768, 70001])
@compiled_ops
def test_squared_norms_match_float64_sums(dtype: torch.dtype, numel: int) -> None:
    tensors = [torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype), torch.randn(3, 5)]
    expected = [tensor.double().square().sum() for tensor in tensors]
    torch.testing.assert_close(native.squared_norms(tensors), torch.stack(expected), rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@compiled_ops
def test_squared_norms_are_finite_exactly_where_tensors_are(dtype: torch.dtype) -> None:
    largest = torch.finfo(dtype).max
    tensors = [torch.full((40000,), largest, dtype=dtype)]  # finite, though its float32 sum of squares overflows
    for bad in (math.nan, math.inf, -math.inf):
        tensor = torch.ones(40000, dtype=dtype)
        tensor[39999] = bad
        tensors.append(tensor)
    assert native.squared_norms(tensors).isfinite().tolist() == [True, False, False, False]


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    """torch sums a bf16 model's norms in bf16 (3 significant digits) and ours in float64, so its total is off in
    the third digit (0.4531 against 0.4544) and the clipped gradients by a bf16 rounding; float32 sums differ in
    their last bits."""
    return dict(rtol=1e-2, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("max_norm", [0.0, 0.05, 1e9, math.inf])  # 0: torch zeroes every gradient
@compiled_ops
def test_clip_matches_torch_clip(dtype: torch.dtype, max_norm: float) -> None:
    model = _model(dtype)
    reference = copy.deepcopy(model)
    opt = cpu_build.Muon(model.parameters(), lr=0.02)
    _backward(model, 0, reference)
    norm = opt.clip_grad_norm_(max_norm)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    torch.testing.assert_close(norm, expected.float(), **_tolerance(dtype))
    for param, expected_param in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, expected_param.grad, **_tolerance(dtype))


@pytest.mark.parametrize("max_norm", [0.05, 1e9, math.inf])
def test_steps_after_our_clip_match_steps_after_torch_s(max_norm: float) -> None:
    """float32 only, and Newton-Schulz in float64: the clips' gradients differ in their last bits, which moves a Muon
    update of this model's nearly rank-deficient (50, 24) matrix by 2% of its size in a float32 iteration (a third
    in bf16), so only a float64 one compares the steps with a tolerance that would catch a bug."""
    model, reference, ours, theirs = _twins(ns_dtype=torch.float64)
    for seed in range(3):
        _backward(model, seed, reference)
        ours.clip_grad_norm_(max_norm)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        ours.step()
        theirs.step()
    for param, expected_param in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param, expected_param, **_tolerance(torch.float32))


def test_gradients_set_under_inference_mode_are_clipped_as_torch_clips_them(package) -> None:
    """Inference tensors have no version counter: reading it raised after the gradients were scaled (a retry scaled
    them twice). Their flags are not kept, so the step checks them itself."""
    model, reference, ours, theirs = _twins(package, ns_dtype=torch.float64)
    with torch.inference_mode():
        for each in (model, reference):
            for index, param in enumerate(each.parameters()):
                param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(index))
        ours.clip_grad_norm_(0.5)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    ours.step()
    theirs.step()
    for param, expected_param in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param, expected_param, **_tolerance(torch.float32))


def _adamw_routed(opt: torch.optim.Optimizer) -> int:
    return sum("exp_avg" in state for state in opt.state.values())


@pytest.mark.parametrize("bad", [None, math.nan, math.inf])
def test_the_step_with_the_clip_s_flags_equals_the_step_with_the_guard(package, bad: float | None) -> None:
    """Both models clipped alike; one's gradients are then touched (`add_(0)` bumps their version, not their
    values), so its step reads them itself: every parameter must come out bit for bit the same."""
    model, reference, ours, theirs = _twins(package)
    for seed in range(2):
        _backward(model, seed, reference)
        if bad is not None and seed == 1:
            _poison(model, bad)
            _poison(reference, bad)
        ours.clip_grad_norm_(10.0)
        theirs.clip_grad_norm_(10.0)
        for param in reference.parameters():
            param.grad.add_(0)
        ours.step()
        theirs.step()
    for param, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param, expected, rtol=0, atol=0)
    # A NaN makes the total NaN, which scales every gradient to NaN; an Inf zeroes the others (Inf * 0 is NaN).
    skipped = {None: 0, math.inf: 1}.get(bad, len(list(model.parameters())))
    assert ours.nonfinite_skips() == theirs.nonfinite_skips() == skipped


def test_the_step_after_a_clip_does_not_read_the_gradients_again(package, monkeypatch: pytest.MonkeyPatch) -> None:
    """The AdamW part gets the clip's flags; without a clip it gets none (None) and checks each gradient itself."""
    model = _model()
    opt = package.Muon(model.parameters(), lr=0.02)
    offload_module = submodule(package, "offload")
    flags_given = []
    real = offload_module.adamw_update
    monkeypatch.setattr(offload_module, "adamw_update", lambda items, found_inf, **settings: flags_given.append(
        None if found_inf is None else len(found_inf)) or real(items, found_inf, **settings))
    _backward(model, 0)
    opt.clip_grad_norm_(1.0)
    opt.step()
    assert flags_given == [_adamw_routed(opt)]
    _backward(model, 1)
    opt.step()  # no clip before this one: the update checks the AdamW-routed gradients
    assert flags_given == [_adamw_routed(opt), None]


def _poison(model: torch.nn.Module, value: float) -> None:
    """A non-finite value in the LayerNorm's weight gradient (an AdamW-routed parameter)."""
    model[2].weight.grad[3] = value


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("max_norm", [1.0, math.inf])
@pytest.mark.parametrize("when", ["before the clip", "after the clip"])
def test_non_finite_gradients_are_skipped_as_after_torch_s_clip(package, bad: float, max_norm: float,
                                                                when: str) -> None:
    """A total norm of NaN scales every gradient to NaN and one of Inf zeroes the finite ones, as torch's clip
    does; a gradient made non-finite after the clip is caught by the step all the same."""
    model, reference, ours, theirs = _twins(package)
    _backward(model, 0, reference)
    if when == "before the clip":
        _poison(model, bad)
        _poison(reference, bad)
    ours.clip_grad_norm_(max_norm)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    if when == "after the clip":
        _poison(model, bad)
        _poison(reference, bad)
    poisoned = model[2].weight.detach().clone()
    ours.step()
    theirs.step()
    for param, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param, expected, **_tolerance(torch.float32))
    torch.testing.assert_close(model[2].weight, poisoned, rtol=0, atol=0)
    assert ours.nonfinite_skips() == theirs.nonfinite_skips() > 0


def test_a_parameter_removed_after_a_clip_is_freed_with_its_model() -> None:
    """The clip's flags held every clipped parameter until the next clip where a step had no AdamW part to use them
    (matrices only)."""
    kept, removed = torch.nn.Parameter(torch.randn(8, 6)), torch.nn.Parameter(torch.randn(6, 4))
    opt = optimizer.Muon([dict(params=[kept]), dict(params=[removed])], lr=0.02)
    kept.grad, removed.grad = torch.randn_like(kept), torch.randn_like(removed)
    opt.clip_grad_norm_(1.0)
    opt.step()
    del opt.param_groups[1], opt.state[removed]
    kept.grad = torch.randn_like(kept)
    opt.step()  # no clip: the held items of the removed group go at this step
    removed_ref = weakref.ref(removed)
    del removed
    gc.collect()
    assert removed_ref() is None


def test_a_gradient_replaced_after_the_clip_is_read_again(package) -> None:
    model = _model()
    opt = package.Muon(model.parameters(), lr=0.02)
    _backward(model, 0)
    opt.clip_grad_norm_(1.0)
    weight = model[2].weight
    before = weight.detach().clone()
    weight.grad = torch.full_like(weight, math.nan)
    opt.step()
    torch.testing.assert_close(weight, before, rtol=0, atol=0)
    assert opt.nonfinite_skips() == 1


def test_error_if_nonfinite_raises_before_anything_is_scaled(package) -> None:
    model = _model()
    opt = package.Muon(model.parameters(), lr=0.02)
    _backward(model, 0)
    _poison(model, math.nan)
    grads = [param.grad.clone() for param in model.parameters()]
    with pytest.raises(RuntimeError, match="total norm"):
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)
    for param, grad in zip(model.parameters(), grads):
        torch.testing.assert_close(param.grad, grad, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("norm_type", [1.0, math.inf])
def test_other_norms_are_torch_s(norm_type: float) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    opt = cpu_build.Muon(model.parameters(), lr=0.02)
    _backward(model, 0, reference)
    norm = opt.clip_grad_norm_(0.1, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1, norm_type=norm_type)
    torch.testing.assert_close(norm, expected, rtol=0, atol=0)
    for param, expected_param in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, expected_param.grad, rtol=0, atol=0)


@pytest.mark.parametrize("max_norm", [-1.0, math.nan, "1", True, None])
def test_invalid_max_norm_raises_value_error_naming_it(max_norm: object) -> None:
    model = _model()
    opt = cpu_build.Muon(model.parameters(), lr=0.02)
    _backward(model, 0)
    grads = [param.grad.clone() for param in model.parameters()]
    with pytest.raises(ValueError, match="max_norm"):
        opt.clip_grad_norm_(max_norm)
    for param, grad in zip(model.parameters(), grads):
        torch.testing.assert_close(param.grad, grad, rtol=0, atol=0)


@compiled_ops
def test_float64_gradients_too_large_to_square_are_finite() -> None:
    """Their float64 squares overflow, so their finite flags come from the exact check: the step goes on."""
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = cpu_build.Muon([dict(params=[param], use_muon=False)], lr=0.02)
    param.grad = torch.full((4,), 1e300, dtype=torch.float64)
    assert opt.clip_grad_norm_(1.0) == math.inf
    opt.step()  # the Inf total zeroes the gradient (as torch's clip does): weight decay of zero, nothing skipped
    assert opt.nonfinite_skips() == 0


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("mixed", [False, True], ids=["one dtype", "float32 and bfloat16"])
def test_tensor_norms_clip_as_torch_s_bit_for_bit(norm_type: float, mixed: bool) -> None:
    """Torch's per-tensor norms, total and scaling, in one call per dtype (torch groups its own calls by dtype too),
    then a step that takes the clip's flags: a NaN made after the clip is still caught by the step's own guard."""
    fallback = load_fallback_variant()
    model = _model()
    if mixed:
        model[1].to(torch.bfloat16)
        model[3].bias.data = model[3].bias.data.bfloat16()
    reference = copy.deepcopy(model)
    opt = fallback.Muon(model.parameters(), lr=0.02)
    for each in (model, reference):  # the same gradients for both, drawn per parameter size
        for param in each.parameters():
            generator = torch.Generator().manual_seed(param.numel())
            param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
    torch.testing.assert_close(opt.clip_grad_norm_(0.05, norm_type),
                               torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type),
                               rtol=0, atol=0)
    for param, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, expected.grad, rtol=0, atol=0)
    _poison(model, math.nan)  # after the clip: only the step's own guard can see it
    poisoned = model[2].weight.detach().clone()
    opt.step()
    torch.testing.assert_close(model[2].weight, poisoned, rtol=0, atol=0)
    assert opt.nonfinite_skips() == 1


def test_tensor_norms_count_a_gradient_whose_norm_overflows_as_not_finite() -> None:
    """Its norm is all the clip reads, so a float64 gradient of 1e300 (whose square overflows) is skipped, where the
    CPU op's exact check lets it through (above); the Inf total zeroes the other gradients, as torch's clip does."""
    param, other = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64)), torch.nn.Parameter(torch.ones(3))
    opt = load_fallback_variant().Muon([dict(params=[param, other], use_muon=False)], lr=0.02)
    param.grad, other.grad = torch.full((4,), 1e300, dtype=torch.float64), torch.ones(3)
    assert opt.clip_grad_norm_(1.0) == math.inf
    opt.step()
    assert opt.nonfinite_skips() == 1
    assert torch.equal(param.detach(), torch.zeros(4, dtype=torch.float64))
    assert torch.equal(other.grad, torch.zeros(3))


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("state_dtype, layer_groups, normalization",
                         [(None, False, None), (torch.bfloat16, False, None), ("int8", False, None), (None, True, None),
                          (None, True, "neuron"), (None, False, "element")])
def test_clip_and_step_on_a_gpu_do_not_sync_with_the_host(state_dtype: torch.dtype | str | None, layer_groups: bool,
                                                           normalization: str | None) -> None:
    """Moments stored rounded too: their counts once moved through a list index, which torch copies to the GPU from
    pageable memory (a sync, and 0.3-0.8 ms of a GPT-2-small step on an H100). A group per layer at its own lr and
    decay: its two same-shape matrices share a bucket, whose per-parameter decay factors reach the GPU from pinned
    memory. NorMuon and AdaMuon: their composition of torch ops, and the RMS rule's step sizes made on the GPU."""
    torch.manual_seed(0)
    blocks = [torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)] if layer_groups else [torch.nn.Linear(16, 16)]
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), *blocks, torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 50)).cuda()
    params = ([dict(params=layer.parameters(), lr=0.02 / (index + 1), weight_decay=0.01 * index)
               for index, layer in enumerate(model)] if layer_groups else model.parameters())
    opt = optimizer.Muon(params, lr=0.02, state_dtype=state_dtype, normalization=normalization)
    tokens = torch.randint(0, 50, (4, 6), device="cuda")
    for _ in range(2):  # the first step creates state and picks paths
        model(tokens).square().mean().backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    model(tokens).square().mean().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.clip_grad_norm_(1.0)
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
