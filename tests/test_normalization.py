"""NorMuon ("neuron") and AdaMuon ("element") normalization against the papers' formulas in float64, with the
properties timm's tests check: the RMS rule, a flattened conv equal to its matrix, skipped steps, checkpoints.

The references below are written from the papers (arXiv 2510.05491, 2507.11005), on top of `zeropower` in float64
(itself tested against the SVD polar factor): momentum, Newton-Schulz, a running mean of the squares per row or per
entry, division by its root, then the RMS rule or the plain lr scaling.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernel_under_test import optimizer

Muon = optimizer.Muon
BETA2, EPS, LR, WD, MOMENTUM = 0.95, 1e-7, 0.05, 0.1, 0.9


def reference_run(weight: torch.Tensor, grads: list[torch.Tensor], normalization: str, adjust_lr_fn: str,
                  nesterov: bool) -> torch.Tensor:
    """The weight after one step per gradient, in float64, from the papers' update rules."""
    weight, buffer = weight.double().clone(), torch.zeros_like(weight, dtype=torch.float64)
    rows, cols = weight.shape
    moment = torch.zeros(rows if normalization == "neuron" else (rows, cols), dtype=torch.float64)
    for step, grad in enumerate(grads, start=1):
        grad = grad.double()
        buffer = MOMENTUM * buffer + (1 - MOMENTUM) * grad
        direction = (1 - MOMENTUM) * grad + MOMENTUM * buffer if nesterov else buffer
        orthogonal = optimizer.zeropower(direction, 5, "polar_express", dtype=torch.float64)
        squares = orthogonal.square().mean(dim=1) if normalization == "neuron" else orthogonal.square()
        moment = BETA2 * moment + (1 - BETA2) * squares
        weight = weight * (1 - LR * WD)
        if adjust_lr_fn == "match_rms_adamw":  # no bias correction: the RMS rescaling cancels it
            scaled = orthogonal / (moment.sqrt().reshape(rows, -1) + EPS)
            weight = weight - LR * 0.2 * math.sqrt(rows * cols) * scaled / (scaled.norm() + EPS)
        else:  # "spectral": sqrt(out / in), with the bias-corrected moment
            corrected = moment / (1 - BETA2 ** step)
            scaled = orthogonal / (corrected.sqrt().reshape(rows, -1) + EPS)
            weight = weight - LR * math.sqrt(rows / cols) * scaled
    return weight


def grads_for(shape: tuple[int, ...], steps: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(steps)]


def train(param: torch.Tensor, grads: list[torch.Tensor], **options) -> Muon:
    opt = Muon([param], lr=LR, weight_decay=WD, momentum=MOMENTUM, eps=EPS, ns_dtype=torch.float64,
               adamw_betas=(0.9, BETA2), **options)
    for grad in grads:
        param.grad = grad.to(param.dtype).reshape(param.shape)
        opt.step()
    return opt


@pytest.mark.parametrize("normalization", ["neuron", "element"])
@pytest.mark.parametrize("adjust_lr_fn", ["match_rms_adamw", "spectral"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("shape", [(12, 20), (20, 12)])
def test_matches_the_papers_update_rule(normalization: str, adjust_lr_fn: str, nesterov: bool,
                                        shape: tuple[int, int]) -> None:
    weight = torch.randn(shape, dtype=torch.float64)
    grads = grads_for(shape, 4)
    param = weight.clone()
    train(param, grads, normalization=normalization, adjust_lr_fn=adjust_lr_fn, nesterov=nesterov)
    torch.testing.assert_close(param, reference_run(weight, grads, normalization, adjust_lr_fn, nesterov),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("normalization", ["neuron", "element"])
def test_rms_rule_gives_the_update_rms_0_2(normalization: str) -> None:
    param = torch.zeros(16, 40, dtype=torch.float64)
    opt = Muon([param], lr=1.0, weight_decay=0.0, ns_dtype=torch.float64, normalization=normalization)
    param.grad = torch.randn(16, 40, dtype=torch.float64)
    opt.step()
    assert param.square().mean().sqrt().item() == pytest.approx(0.2, rel=1e-6)


@pytest.mark.parametrize("normalization", ["neuron", "element"])
def test_a_flattened_conv_follows_its_matrix(normalization: str) -> None:
    conv = torch.randn(8, 4, 3, 3, dtype=torch.float64)
    matrix = conv.reshape(8, 36).clone()
    grads = grads_for((8, 36), 3)
    conv_opt = train(conv, grads, normalization=normalization)
    matrix_opt = train(matrix, grads, normalization=normalization)
    torch.testing.assert_close(conv.reshape(8, 36), matrix, rtol=0, atol=1e-14)
    conv_state, matrix_state = conv_opt.state[conv], matrix_opt.state[matrix]
    torch.testing.assert_close(conv_state["update_sq"].reshape(matrix_state["update_sq"].shape),
                               matrix_state["update_sq"], rtol=0, atol=1e-14)
    assert conv_state["update_step"].item() == matrix_state["update_step"].item() == 3


@pytest.mark.parametrize("normalization", ["neuron", "element"])
@pytest.mark.parametrize("shape,matrices,matrix_at", [
    ((6, 4, 2, 2), 4, lambda tensor, k: tensor[:, :, k // 2, k % 2]),  # batched conv: a matrix per kernel position
    ((3, 6, 8), 3, lambda tensor, k: tensor[k]),  # expert bank: one matrix per expert
], ids=["batched_conv", "experts"])
def test_each_matrix_of_a_stack_keeps_its_own_second_moment(normalization: str, shape: tuple[int, ...],
                                                            matrices: int, matrix_at) -> None:
    """Without the RMS rule (which scales the whole parameter), a stack's matrices are independent: each follows
    the run of that matrix alone, its second moment included."""
    stack, grads = torch.randn(shape, dtype=torch.float64), grads_for(shape, 3)
    options = dict(normalization=normalization, adjust_lr_fn="spectral", conv_mode="batched")
    original = stack.clone()
    stack_opt = train(stack, grads, **options)
    for k in range(matrices):
        matrix = matrix_at(original, k).clone()
        matrix_opt = train(matrix, [matrix_at(grad, k) for grad in grads], **options)
        torch.testing.assert_close(matrix_at(stack, k), matrix, rtol=0, atol=1e-14)
        torch.testing.assert_close(matrix_at(stack_opt.state[stack]["update_sq"], k).reshape(-1),
                                   matrix_opt.state[matrix]["update_sq"].reshape(-1), rtol=0, atol=1e-14)


def test_a_nonfinite_gradient_leaves_parameter_and_second_moment_untouched() -> None:
    param = torch.randn(10, 14, dtype=torch.float64)
    opt = train(param, grads_for((10, 14), 2), normalization="element", adjust_lr_fn="spectral")
    before = {key: value.clone() for key, value in opt.state[param].items()}
    weight = param.clone()
    bad = torch.randn(10, 14, dtype=torch.float64)
    bad[3, 4] = float("nan")
    param.grad = bad
    opt.step()
    assert torch.equal(param, weight)
    for key in ("update_sq", "update_step", "momentum_buffer"):
        assert torch.equal(opt.state[param][key], before[key]), key
    assert opt.nonfinite_skips() == 1


def test_second_moment_stays_float32_for_bf16_parameters_through_a_checkpoint() -> None:
    param = torch.randn(12, 24).bfloat16()
    opt = train(param, grads_for((12, 24), 2), normalization="neuron")
    restored = Muon([param.clone()], lr=LR, normalization="neuron")
    restored.load_state_dict(opt.state_dict())
    state = restored.state[restored.param_groups[0]["params"][0]]
    assert state["update_sq"].dtype == torch.float32 and state["update_sq"].shape == (12, 1)
    assert torch.equal(state["update_sq"], opt.state[param]["update_sq"])
    assert state["update_step"].dtype == torch.float32 and state["update_step"].item() == 2


def test_training_on_after_a_checkpoint_equals_training_through() -> None:
    weight, grads = torch.randn(9, 15, dtype=torch.float64), grads_for((9, 15), 6)
    through = weight.clone()
    train(through, grads, normalization="element", adjust_lr_fn="spectral")
    first = weight.clone()
    opt = train(first, grads[:3], normalization="element", adjust_lr_fn="spectral")
    second = first.clone()
    resumed = Muon([second], lr=LR, weight_decay=WD, momentum=MOMENTUM, eps=EPS, ns_dtype=torch.float64,
                   adamw_betas=(0.9, BETA2), normalization="element", adjust_lr_fn="spectral")
    resumed.load_state_dict(opt.state_dict())
    for grad in grads[3:]:
        second.grad = grad
        resumed.step()
    assert torch.equal(second, through)


def test_timm_algo_adamuon_is_element_normalization() -> None:
    weight, grads = torch.randn(10, 16, dtype=torch.float64), grads_for((10, 16), 3)
    ours, timms = weight.clone(), weight.clone()
    train(ours, grads, normalization="element")
    opt = train(timms, grads, algo="adamuon")
    assert opt.param_groups[0]["normalization"] == "element" and "algo" not in opt.param_groups[0]
    assert torch.equal(ours, timms)
    assert Muon([torch.randn(4, 8)], algo="muon").param_groups[0]["normalization"] is None
    # timm's algo="muon" is no normalization, also in a group beside a default of "element", and set between steps.
    assert Muon([dict(params=[torch.randn(4, 8)], algo="muon")],
                normalization="element").param_groups[0]["normalization"] is None
    opt.param_groups[0]["algo"] = "muon"
    timms.grad = grads[0]
    opt.step()
    assert opt.param_groups[0]["normalization"] is None and "algo" not in opt.param_groups[0]


def test_bad_normalization_options_are_refused_before_anything_changes() -> None:
    with pytest.raises(ValueError, match="Invalid normalization: 'row'"):
        Muon([torch.randn(4, 8)], normalization="row")
    with pytest.raises(ValueError, match="Invalid algo: 'nadam'"):
        Muon([torch.randn(4, 8)], algo="nadam")
    with pytest.raises(ValueError, match="Invalid algo: 'adamuon' given with normalization='neuron'"):
        Muon([torch.randn(4, 8)], algo="adamuon", normalization="neuron")
    first, second = torch.randn(6, 10, dtype=torch.float64), torch.randn(6, 10, dtype=torch.float64)
    opt = Muon([dict(params=[first]), dict(params=[second])], lr=LR, ns_dtype=torch.float64, normalization="element")
    first.grad, second.grad = grads_for((6, 10), 2)
    opt.step()
    opt.param_groups[1]["normalization"] = "neuron"  # its saved second moment has the other shape
    weights = [first.clone(), second.clone()]
    with pytest.raises(ValueError, match=r"'neuron' needs a second moment of shape \(6, 1\)"):
        opt.step()
    assert torch.equal(first, weights[0]) and torch.equal(second, weights[1])  # the first group did not step either
