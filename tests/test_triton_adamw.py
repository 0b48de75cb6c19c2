"""The Triton AdamW over many tensors with a skip flag per tensor, against torch's fused AdamW, under the Triton
interpreter on the CPU (and on a GPU where one runs the tests)."""

import importlib

import pytest
import torch
from triton_under_test import DEVICE, INTERPRETER, needs_kernels, triton_kernels

adamw_flagged_ = triton_kernels.adamw_flagged_
BLOCK = importlib.import_module(f"{triton_kernels.__name__}.adamw").BLOCK if triton_kernels.TRITON_AVAILABLE else 2048

# Sizes on and around a program's block, several blocks, a matrix and an empty tensor.
SHAPES = [(1,), (BLOCK - 1,), (BLOCK,), (BLOCK + 1,), (2 * BLOCK + 904,), (3, 7), (0,)]
SETTINGS = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def random_tensors(dtype: torch.dtype, generator: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(shape, generator=generator).to(dtype).to(DEVICE) for shape in SHAPES]


class Stepped:
    """Parameters with their moments and step counts, stepped by adamw_flagged_, beside clones stepped by torch's
    fused AdamW (its fp32 arithmetic, one rounding per stored value)."""

    def __init__(self, dtype: torch.dtype, settings: dict, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.dtype, self.settings = dtype, settings
        self.params = random_tensors(dtype, self.generator)
        self.exp_avgs = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sqs = [torch.zeros_like(p) for p in self.params]
        self.steps = [torch.zeros((), device=DEVICE) for _ in self.params]
        self.reference = [p.clone().requires_grad_() for p in self.params]
        self.torch_adamw = torch.optim.AdamW(self.reference, fused=True, **settings)

    def step(self, skipped: list[bool]) -> None:
        grads = random_tensors(self.dtype, self.generator)
        for reference, grad, skip in zip(self.reference, grads, skipped):
            reference.grad = None if skip else grad.clone()
        self.torch_adamw.step()
        flags = torch.tensor(skipped, dtype=torch.float32, device=DEVICE)
        for grad, skip in zip(grads, skipped):
            if skip:
                grad.view(-1)[:1] = float("nan")  # a skipped tensor's gradient is never read
        adamw_flagged_(self.params, grads, self.exp_avgs, self.exp_avg_sqs, self.steps, flags, **self.settings)
        # The op moves the step counts of the tensors it stepped, as torch's AdamW keeps them.
        for index, step in enumerate(self.steps):
            assert float(step) == float(self.torch_adamw.state.get(self.reference[index], {}).get("step", 0.0))

    def torch_state(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        reference = self.reference[index]
        state = self.torch_adamw.state.get(reference, {})
        zeros = torch.zeros_like(reference)
        return reference.detach(), state.get("exp_avg", zeros), state.get("exp_avg_sq", zeros)

    def ours(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.params[index], self.exp_avgs[index], self.exp_avg_sqs[index]


@needs_kernels
@pytest.mark.parametrize("settings", [SETTINGS, dict(lr=3e-3, betas=(0.0, 0.99), eps=1e-6, weight_decay=0.0)],
                         ids=["decay", "beta1_zero"])
def test_float32_matches_torch_fused_adamw_over_steps(settings: dict) -> None:
    stepped = Stepped(torch.float32, settings)
    for _ in range(3):
        stepped.step([False] * len(SHAPES))
    for index in range(len(SHAPES)):
        for ours, theirs in zip(stepped.ours(index), stepped.torch_state(index)):
            # The same fp32 arithmetic; the bias corrections and the scalars' rounding may differ by an ulp.
            torch.testing.assert_close(ours, theirs, rtol=4e-6, atol=1e-7)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_tensors_round_once_like_torch_fused_adamw(dtype: torch.dtype) -> None:
    stepped = Stepped(dtype, SETTINGS)
    stepped.step([False] * len(SHAPES))
    # Both compute in fp32 and store once: the results differ by the last rounding, at most an ulp of the result
    # (the interpreter truncates fp32 -> 16-bit stores, GPUs round), which is at most eps * |value|.
    eps = torch.finfo(dtype).eps
    for index in range(len(SHAPES)):
        for ours, theirs in zip(stepped.ours(index), stepped.torch_state(index)):
            bound = eps * theirs.float().abs() + torch.finfo(dtype).smallest_normal
            assert ((ours.float() - theirs.float()).abs() <= bound).all()


@needs_kernels
def test_skipped_tensors_keep_parameter_and_moments_bit_for_bit() -> None:
    stepped = Stepped(torch.float32, SETTINGS)
    stepped.step([False] * len(SHAPES))
    before = [tuple(t.clone() for t in stepped.ours(index)) for index in range(len(SHAPES))]
    skipped = [index % 2 == 1 for index in range(len(SHAPES))]
    stepped.step(skipped)
    for index, skip in enumerate(skipped):
        if skip:
            assert all(torch.equal(now, then) for now, then in zip(stepped.ours(index), before[index]))
        else:
            for ours, theirs in zip(stepped.ours(index), stepped.torch_state(index)):
                torch.testing.assert_close(ours, theirs, rtol=4e-6, atol=1e-7)


@needs_kernels
def test_lr_on_the_device_matches_torch_fused_adamw_with_that_lr() -> None:
    stepped = Stepped(torch.float32, {**SETTINGS, "lr": torch.tensor(SETTINGS["lr"], device=DEVICE)})
    for _ in range(2):
        stepped.step([False] * len(SHAPES))
    for index in range(len(SHAPES)):
        for ours, theirs in zip(stepped.ours(index), stepped.torch_state(index)):
            torch.testing.assert_close(ours, theirs, rtol=4e-6, atol=1e-7)


@needs_kernels
def test_rates_per_tensor_match_torch_fused_adamw_with_a_group_each() -> None:
    # Param groups that differ only in lr and weight decay share a launch, each tensor reading its own pair.
    adamw = importlib.import_module(f"{triton_kernels.__name__}.adamw")
    generator = torch.Generator().manual_seed(3)
    params = random_tensors(torch.float32, generator)
    rates = [(0.01 * (index + 1), 0.05 * index) for index in range(len(params))]
    moments = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    steps = [torch.zeros((), device=DEVICE) for _ in params]
    reference = [p.clone().requires_grad_() for p in params]
    torch_adamw = torch.optim.AdamW([dict(params=[p], lr=lr, weight_decay=decay) for p, (lr, decay) in
                                     zip(reference, rates)], betas=(0.9, 0.95), eps=1e-8, fused=True)
    pairs = torch.tensor(rates, dtype=torch.float64, device=DEVICE)
    for _ in range(2):
        grads = random_tensors(torch.float32, generator)
        for p, grad in zip(reference, grads):
            p.grad = grad.clone()
        torch_adamw.step()
        tabulated = adamw.tabulate(list(zip(params, grads, *moments, steps)))
        skipped = torch.zeros(len(params), device=DEVICE)
        adamw.launch_adamw_(tabulated, skipped, lr=0.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, rates=pairs)
        adamw.launch_counts_(tabulated, skipped)
    for index, p in enumerate(reference):
        state = torch_adamw.state[p]
        for ours, theirs in zip((params[index], moments[0][index], moments[1][index]),
                                (p.detach(), state["exp_avg"], state["exp_avg_sq"])):
            torch.testing.assert_close(ours, theirs, rtol=4e-6, atol=1e-7)


def _tensors(count: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(4, dtype=dtype, device=DEVICE) for _ in range(count)]


@needs_kernels
@pytest.mark.parametrize(("arguments", "message"), [
    (lambda: (_tensors(2), _tensors(1), _tensors(2), _tensors(2), _tensors(2, torch.float32), torch.zeros(2)),
     r"one of each per parameter.*'grads': 1"),
    (lambda: (_tensors(1), _tensors(1), _tensors(1), _tensors(1), [torch.zeros(())], torch.zeros(3)),
     r"skipped of shape \(3,\)"),
    (lambda: (_tensors(1), _tensors(1, torch.float16), _tensors(1), _tensors(1), [torch.zeros(())], torch.zeros(1)),
     r"grads\[0\] is \(4,\) torch.float16"),
    (lambda: (_tensors(1), [torch.zeros(8, device=DEVICE)[::2]], _tensors(1), _tensors(1), [torch.zeros(())], torch.zeros(1)),
     r"grads\[0\] is not contiguous from a 16-byte boundary \(strides \(2,\)"),
    (lambda: (_tensors(1), _tensors(1), [torch.zeros(5, device=DEVICE)[1:]], _tensors(1), [torch.zeros(())], torch.zeros(1)),
     r"exp_avgs\[0\] is not contiguous from a 16-byte boundary \(strides \(1,\), starting at 0x"),
    (lambda: (_tensors(1, torch.int32), _tensors(1, torch.int32), _tensors(1, torch.int32),
              _tensors(1, torch.int32), [torch.zeros(())], torch.zeros(1)), "params have dtype torch.int32"),
    (lambda: (_tensors(1), _tensors(1), _tensors(1), _tensors(1), [torch.zeros((), dtype=torch.int64)],
              torch.zeros(1)), r"steps\[0\] is \(\) torch.int64"),
    (lambda: (_tensors(1), _tensors(1), _tensors(1), _tensors(1), [torch.zeros(())], torch.zeros(1, dtype=torch.int8)),
     "skipped is torch.int8"),
])
def test_bad_arguments_raise_value_error_naming_them(arguments, message: str) -> None:
    params, grads, exp_avgs, exp_avg_sqs, steps, skipped = arguments()
    steps = [step.to(DEVICE) for step in steps]
    with pytest.raises(ValueError, match=message):
        adamw_flagged_(params, grads, exp_avgs, exp_avg_sqs, steps, skipped.to(DEVICE), **SETTINGS)


@needs_kernels
def test_an_lr_tensor_of_several_elements_is_refused_before_any_write() -> None:
    params = _tensors(1)
    with pytest.raises(ValueError, match=r"lr is a tensor of shape \(2,\)"):
        adamw_flagged_(params, _tensors(1), _tensors(1), _tensors(1), [torch.zeros((), device=DEVICE)],
                       torch.zeros(1, device=DEVICE), **{**SETTINGS, "lr": torch.ones(2, device=DEVICE)})
    assert torch.equal(params[0], torch.zeros(4, device=DEVICE))


@pytest.mark.skipif(not INTERPRETER, reason="the interpreter's CPU tensors")
@needs_kernels
def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.import_module(f"{triton_kernels.__name__}.adamw"), "INTERPRETER", False)
    with pytest.raises(ValueError, match="the tensors are on the CPU"):
        adamw_flagged_(_tensors(1), _tensors(1), _tensors(1), _tensors(1), [torch.zeros(())], torch.zeros(1),
                       **SETTINGS)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gradients_holding_nan_or_inf_are_flagged_on_the_device_as_torch_finds_them(dtype: torch.dtype) -> None:
    adamw = importlib.import_module(f"{triton_kernels.__name__}.adamw")
    generator = torch.Generator().manual_seed(1)
    grads = random_tensors(dtype, generator)
    # One non-finite entry each: a one-entry tensor, the entry just past a first block, the last entry of a third
    # block, a matrix's last entry; the empty tensor is finite.
    for index, position, value in [(0, 0, float("nan")), (3, BLOCK, float("inf")), (4, -1, -float("inf")),
                                   (5, 20, float("nan"))]:
        grads[index].view(-1)[position] = value
    grads[2].view(-1)[-1] = torch.finfo(dtype).max  # the largest finite value stays finite
    rows = [(torch.zeros_like(grad), grad, torch.zeros_like(grad), torch.zeros_like(grad),
             torch.zeros((), device=DEVICE)) for grad in grads]
    flags = adamw.launch_nonfinite_(adamw.tabulate(rows))
    expected = torch.tensor([float(not grad.isfinite().all()) for grad in grads], device=DEVICE)
    assert torch.equal(flags, expected) and expected.sum() == 4
