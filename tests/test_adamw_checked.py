"""The compiled `adamw_checked_` op (AdamW on float32 or bfloat16 parameters and moments, each gradient checked for
NaN and Inf just before its parameter's update, all parameters in one call) against torch's fused AdamW, whose
formula it computes, and its flags against where the gradients' non-finite entries really are."""

from __future__ import annotations

import pytest
import torch
from kernel_under_test import compiled_ops, load_cpu_variant, submodule

pytestmark = compiled_ops

native = submodule(load_cpu_variant(), "native")
SETTINGS = dict(lr=0.01, eps=1e-8, weight_decay=0.1)
# Sizes: below a vector's width, an odd size past the op's prefetch distance, and one spread over both threads.
SIZES = (37, 5003, 70001)


def _parameters(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=generator).to(dtype) for size in SIZES]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [(0.1 * torch.randn(param.shape, generator=generator)).to(param.dtype) for param in params]


def _ours(params: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    return dict(exp_avgs=[torch.zeros_like(p) for p in params], exp_avg_sqs=[torch.zeros_like(p) for p in params],
                steps=[torch.zeros(()) for _ in params])


def _step(params: list[torch.Tensor], grads: list[torch.Tensor], state: dict[str, list[torch.Tensor]],
          found_inf: torch.Tensor | None, betas: tuple[float, float] = (0.9, 0.95)) -> torch.Tensor:
    return native.adamw_checked_(params, grads, state["exp_avgs"], state["exp_avg_sqs"], state["steps"], found_inf,
                                 betas=betas, **SETTINGS)


# beta1 = 0.3: 1 - beta1 above 0.5 takes torch.lerp's other formula.
@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.3, 0.999)], ids=["beta1 0.9", "beta1 0.3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_five_steps_match_torch_fused_adamw(dtype: torch.dtype, betas: tuple[float, float]) -> None:
    ours, theirs = _parameters(0, dtype), _parameters(0, dtype)
    state = _ours(ours)
    reference = torch.optim.AdamW(theirs, betas=betas, fused=True, **SETTINGS)
    for step in range(5):
        grads = _grads(ours, step)
        for param, grad in zip(theirs, grads):
            param.grad = grad.clone()
        flags = _step(ours, grads, state, None, betas)
        reference.step()
        assert flags.tolist() == [0.0] * len(SIZES)
    for param, expected, m, v, count in zip(ours, theirs, state["exp_avgs"], state["exp_avg_sqs"], state["steps"]):
        torch_state = reference.state[expected]
        assert float(count) == float(torch_state["step"]) == 5.0
        for mine, torch_value in ((param, expected), (m, torch_state["exp_avg"]), (v, torch_state["exp_avg_sq"])):
            if dtype == torch.float32:
                # The same float32 formula; torch's vector loop fuses the lerp's multiply-add: a few ulps in 5 steps.
                torch.testing.assert_close(mine, torch_value, rtol=1e-6, atol=1e-7)
                continue
            # bfloat16: the same float32 arithmetic rounded once per stored value; where a float32 ulp decides a
            # rounding, the stored values part by one bfloat16 ulp, at most one per step.
            bound = 5 * torch.finfo(dtype).eps * torch_value.float().abs() + 5 * torch.finfo(dtype).tiny
            assert ((mine.float() - torch_value.float()).abs() <= bound).all()


def test_rates_per_parameter_match_torch_fused_adamw_with_a_group_each() -> None:
    # Param groups that differ only in lr and weight decay share one call, each parameter with its group's.
    rates = [(0.01, 0.1), (0.003, 0.0), (0.02, 0.3)]
    ours, theirs = _parameters(3), _parameters(3)
    state = _ours(ours)
    reference = torch.optim.AdamW([dict(params=[param], lr=lr, weight_decay=decay)
                                   for param, (lr, decay) in zip(theirs, rates)], betas=(0.9, 0.95), eps=1e-8,
                                  fused=True)
    for step in range(3):
        grads = _grads(ours, step)
        for param, grad in zip(theirs, grads):
            param.grad = grad.clone()
        native.adamw_checked_(ours, grads, state["exp_avgs"], state["exp_avg_sqs"], state["steps"], None,
                              lr=[lr for lr, _ in rates], betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=[decay for _, decay in rates])
        reference.step()
    for param, expected in zip(ours, theirs):
        torch.testing.assert_close(param, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_the_check_flags_exactly_the_nonfinite_gradients_and_skips_only_them(bad: float, dtype: torch.dtype) -> None:
    params = _parameters(1, dtype)
    state = _ours(params)
    _step(params, _grads(params, 0), state, None)
    grads = _grads(params, 1)
    grads[1][4999] = bad  # in the last line, past the check's four streams
    grads[2][0] = bad
    before = [t.clone() for t in params + state["exp_avgs"] + state["exp_avg_sqs"] + state["steps"]]
    flags = _step(params, grads, state, None)
    assert flags.tolist() == [0.0, 1.0, 1.0]
    after = params + state["exp_avgs"] + state["exp_avg_sqs"] + state["steps"]
    changed = [not torch.equal(old, new) for old, new in zip(before, after)]
    assert changed == [True, False, False] * 4  # params, exp_avgs, exp_avg_sqs, steps: only the first's moved


def test_given_flags_are_obeyed_and_the_gradients_not_read() -> None:
    params = _parameters(2)
    state = _ours(params)
    grads = _grads(params, 0)
    grads[0][3] = float("nan")  # flagged 0 on purpose: the op takes the caller's word
    before = [p.clone() for p in params]
    flags = torch.tensor([0.0, 1.0, 0.0])
    assert _step(params, grads, state, flags) is flags
    assert flags.tolist() == [0.0, 1.0, 0.0]
    assert torch.isnan(params[0][3]) and torch.equal(params[1], before[1]) and not torch.equal(params[2], before[2])
    assert [float(count) for count in state["steps"]] == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_tensors_and_another_gradient_dtype_step_as_contiguous_copies_would(dtype: torch.dtype) -> None:
    # A column and a transposed matrix (the op's loop walks memory as if it were contiguous), their moments strided
    # alike, and float32 gradients (one transposed) for bfloat16 parameters: each must take exactly the step its
    # contiguous copies take, and nothing beside the views may change.
    generator = torch.Generator().manual_seed(3)
    columns = [torch.rand(6, 50, generator=generator).to(dtype) for _ in range(3)]  # param, exp_avg, exp_avg_sq
    matrices = [torch.rand(40, 30, generator=generator).to(dtype) for _ in range(3)]
    views = [[column[:, 7] for column in columns], [matrix.t() for matrix in matrices]]  # per parameter
    twins = [[view.clone(memory_format=torch.contiguous_format) for view in each] for each in views]
    grads = [torch.randn(6, generator=generator), torch.randn(40, 30, generator=generator).t()]
    before = [column.clone() for column in columns]

    def step(tensors: list[list[torch.Tensor]], gradients: list[torch.Tensor]) -> torch.Tensor:
        params, exp_avgs, exp_avg_sqs = zip(*tensors)
        return native.adamw_checked_(list(params), gradients, list(exp_avgs), list(exp_avg_sqs),
                                     [torch.zeros(()) for _ in tensors], None, betas=(0.9, 0.95), **SETTINGS)

    assert step(views, grads).tolist() == step(twins, [g.to(dtype).contiguous() for g in grads]).tolist() == [0, 0]
    for each, each_twins in zip(views, twins):
        for view, twin in zip(each, each_twins):
            assert torch.equal(view, twin)
    assert not torch.equal(columns[0][:, 7], before[0][:, 7])  # stepped
    beside = torch.ones(6, 50, dtype=torch.bool)
    beside[:, 7] = False
    assert all(torch.equal(column[beside], old[beside]) for column, old in zip(columns, before))


def _bad_calls() -> list[tuple[str, dict, str]]:
    def arguments(**changes) -> dict:
        call = dict(params=[torch.zeros(4, 8)], grads=[torch.zeros(4, 8)], exp_avgs=[torch.zeros(4, 8)],
                    exp_avg_sqs=[torch.zeros(4, 8)], steps=[torch.tensor(1.0)], found_inf=torch.zeros(1), check=True,
                    lr=[0.1], beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=[0.0])
        call.update(changes)
        return call

    return [
        ("list lengths", arguments(grads=[]), "grads has 0 tensors but params has 1"),
        ("float64", arguments(params=[torch.zeros(4, 8, dtype=torch.float64)]), r"params\[0\] has dtype Double"),
        ("float16", arguments(params=[torch.zeros(4, 8, dtype=torch.float16)]),
         r"Half \(expected float32 or bfloat16\)"),
        ("grad shape", arguments(grads=[torch.zeros(4, 7)]), r"grads\[0\] must be a floating tensor of shape"),
        ("integer grad", arguments(grads=[torch.zeros(4, 8, dtype=torch.int32)]), r"grads\[0\] must be a floating"),
        ("moment dtype", arguments(exp_avgs=[torch.zeros(4, 8, dtype=torch.bfloat16)]), r"exp_avgs\[0\] must be"),
        ("moment shape", arguments(exp_avg_sqs=[torch.zeros(8, 4)]), r"exp_avg_sqs\[0\] must be of shape"),
        ("step dtype", arguments(steps=[torch.tensor(1)]), r"steps\[0\] must be one float32"),
        ("flags shape", arguments(found_inf=torch.zeros(2)), "found_inf must be a contiguous float32 tensor of shape"),
        ("beta1 of 1", arguments(beta1=1.0), r"beta1 must be in \[0, 1\)"),
        ("lr per parameter", arguments(lr=[0.1, 0.2]), r"lr has 2 values \(expected 1 for every parameter, or one"),
        ("no weight decay", arguments(weight_decay=[]), "weight_decay has 0 values"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())), ids=[case for case, _, _ in _bad_calls()])
def test_bad_arguments_are_refused_by_name_before_anything_changes(case: int) -> None:
    _, call, message = _bad_calls()[case]
    tensors = [value for value in call.values() if isinstance(value, torch.Tensor)]
    tensors += [tensor for value in call.values() if isinstance(value, list) for tensor in value
                if isinstance(tensor, torch.Tensor)]
    before = [tensor.clone() for tensor in tensors]
    with pytest.raises(ValueError, match=message):
        submodule(load_cpu_variant(), "_ops").ops.adamw_checked_(*call.values())
    assert all(torch.equal(old, new) for old, new in zip(before, tensors))


def test_the_optimizer_checks_and_steps_its_adamw_part_in_one_call() -> None:
    params = [torch.randn(300), torch.randn(7, 5).t()]  # the second a transposed view: stepped through a copy
    expected = [p.clone(memory_format=torch.contiguous_format) for p in params]
    for param, twin in zip(params, expected):
        param.grad = torch.randn(param.shape)
        twin.grad = param.grad.clone(memory_format=torch.contiguous_format)
    opt = load_cpu_variant().Muon([dict(params=params, use_muon=False)], lr=0.01, adamw_lr=0.01)
    with torch.profiler.profile() as profile:
        opt.step()
    names = [event.name for event in profile.events()]
    assert sum(name.endswith("::adamw_checked_") for name in names) == 1
    assert not any(name.endswith("::finite_flags_") or name == "aten::_fused_adamw_" for name in names)
    torch.optim.AdamW(expected, lr=0.01, betas=(0.9, 0.95), weight_decay=0.1, fused=True).step()
    for param, twin in zip(params, expected):
        torch.testing.assert_close(param, twin, rtol=1e-6, atol=1e-7)
