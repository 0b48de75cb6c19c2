"""The compiled `adamw_rounded_` op (one AdamW step on bfloat16 or 8-bit-coded moments, read, stepped and stored back
in one pass) against AdamW in float64 on the values the stored moments held, and against the composition it
replaces (load the moments, torch's fused AdamW, store them back), which the package's fallback runs."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_under_test import compiled_ops, load_cpu_variant, load_fallback_variant, submodule
from test_state_precision import adamw_trained

pytestmark = compiled_ops

native = submodule(load_cpu_variant(), "native")
state_precision = submodule(load_cpu_variant(), "state_precision")
SETTINGS = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
FORMS = ["bfloat16", "int8"]


def _moments(form: str, shape: tuple[int, ...], generator: torch.Generator) -> dict[str, torch.Tensor | None]:
    """Stored moments as a few steps of training leave them: a signed first moment, a second of its squares' size."""
    values = {"exp_avg": 0.1 * torch.randn(shape, generator=generator),
              "exp_avg_sq": 0.01 * torch.randn(shape, generator=generator).square()}
    values["exp_avg_sq"].view(-1)[:5] = 0.0  # entries whose second moment rounds to nothing
    stored: dict[str, torch.Tensor | None] = {}
    for key, value in values.items():
        if form == "bfloat16":
            stored[key], stored[f"{key}_scales"] = value.bfloat16(), None
        else:
            stored[key] = torch.empty(shape, dtype=torch.int8)
            stored[f"{key}_scales"] = torch.empty(state_precision.scales_shape(shape))
            state_precision.store_([key], [stored[key]], [stored[f"{key}_scales"]], [value], [torch.tensor(3)],
                                   torch.ones(1), [None])
    return stored


def _values(stored: dict[str, torch.Tensor | None], key: str) -> torch.Tensor:
    return state_precision.working_copy(key, stored[key], stored[f"{key}_scales"]).double()


def _one_code_step(form: str, values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """The spacing of the stored form around `values` (float64): a bound on one stochastic rounding."""
    if form == "bfloat16":
        return values.abs() * 2.0 ** -7 + 1e-38
    block_scales = scales.repeat_interleave(state_precision.BLOCK, dim=-1)[..., :values.shape[-1]].double()
    return values.abs() * 2.0 ** -3 + block_scales * 2.0 ** -9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("form", FORMS)
def test_one_step_against_float64_adamw(form: str, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    shape = (37, 300)  # two blocks per line, the second partial
    param = torch.randn(shape, generator=generator).to(dtype)
    grad = (0.1 * torch.randn(shape, generator=generator)).to(dtype)
    stored = _moments(form, shape, generator)
    m0, v0 = _values(stored, "exp_avg"), _values(stored, "exp_avg_sq")
    if form == "int8":  # a first moment whose 8-bit second moment rounded to nothing is nothing
        m0 = torch.where(v0 == 0, 0.0, m0)
    step, (beta1, beta2) = 4, SETTINGS["betas"]
    g, p0 = grad.double(), param.double()
    m = m0 + (1 - beta1) * (g - m0)
    v = beta2 * v0 + (1 - beta2) * g * g
    denominator = v.sqrt() / math.sqrt(1 - beta2 ** step) + SETTINGS["eps"]
    expected = p0 * (1 - SETTINGS["lr"] * SETTINGS["weight_decay"]) - SETTINGS["lr"] / (1 - beta1 ** step) * m / denominator
    native.adamw_rounded_(param, grad, stored["exp_avg"], stored["exp_avg_scales"], stored["exp_avg_sq"],
                          stored["exp_avg_sq_scales"], torch.tensor([3]), None, torch.tensor(float(step)), **SETTINGS)
    # float32 arithmetic, then the parameter's own rounding
    bound = 1e-5 * (p0.abs() + SETTINGS["lr"] * 10) + torch.finfo(dtype).eps * expected.abs()
    assert ((param.double() - expected).abs() <= bound).all()
    stored_m, stored_root = _values(stored, "exp_avg"), _values(stored, "exp_avg_sq").sqrt()
    assert ((stored_m - m).abs() <= _one_code_step(form, m, stored["exp_avg_scales"])).all()
    assert ((stored_root - v.sqrt()).abs() <= _one_code_step(form, v.sqrt(), stored["exp_avg_sq_scales"])).all()


@pytest.mark.parametrize("form", FORMS)
def test_training_matches_the_composition_it_replaces(form: str) -> None:
    # Ten steps of the package (the compiled op) and of its fallback build (load, torch's fused AdamW, store): the
    # same random bits round both, so they differ only where float32 roundings of the two formulas straddle a code
    # (rarely), and by the last bits of a block's scale when its largest entry's roundings differ.
    state_dtype = torch.bfloat16 if form == "bfloat16" else "int8"
    start = torch.randn(16, 320)
    ours, our_state = adamw_trained(load_cpu_variant(), start, 10, state_dtype)
    theirs, their_state = adamw_trained(load_fallback_variant(), start, 10, state_dtype)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    for key in ("exp_avg", "exp_avg_sq"):
        ours_values = state_precision.working_copy(key, *state_precision.stored_moment(our_state, key)).double()
        theirs_values = state_precision.working_copy(key, *state_precision.stored_moment(their_state, key)).double()
        differs = ((ours_values - theirs_values).abs() > 1e-5 * theirs_values.abs()).double().mean().item()
        assert differs < 0.01, f"{key}: {differs:.2%} of the entries differ"


def test_the_optimizer_steps_through_the_op() -> None:
    param = torch.randn(8, 256)
    param.grad = torch.randn(8, 256)
    opt = load_cpu_variant().Muon([dict(params=[param], use_muon=False)], lr=0.01, state_dtype="int8")
    with torch.profiler.profile() as profile:
        opt.step()
    names = [event.name for event in profile.events()]
    assert any(name.endswith("::adamw_rounded_") for name in names)
    assert not any(name.endswith("::store_moment_") for name in names)


def _bad_calls() -> list[tuple[str, dict, str]]:
    def arguments(**changes) -> dict:
        codes, scales = torch.zeros(4, 8, dtype=torch.int8), torch.zeros(4, 1)
        call = dict(param=torch.zeros(4, 8), grad=torch.zeros(4, 8), exp_avg=codes, exp_avg_scales=scales,
                    exp_avg_sq=codes.clone(), exp_avg_sq_scales=scales.clone(), rounding_count=torch.tensor([0]),
                    row_positions=None, column_positions=None, step=torch.tensor(1.0), lr=0.1, beta1=0.9,
                    beta2=0.99, eps=1e-8, weight_decay=0.0)
        call.update(changes)
        return call

    return [
        ("grad shape", arguments(grad=torch.zeros(4, 7)), "grad must be contiguous, of shape"),
        ("mixed forms", arguments(exp_avg_sq=torch.zeros(4, 8, dtype=torch.bfloat16), exp_avg_sq_scales=None),
         "must be stored in the same form"),
        ("scales shape", arguments(exp_avg_scales=torch.zeros(4, 2)), "scales must be a contiguous float32"),
        ("moment shape", arguments(exp_avg=torch.zeros(4, 9, dtype=torch.int8)), "stored must be contiguous, of shape"),
        ("step dtype", arguments(step=torch.tensor(1)), "step must be one float32"),
        ("beta2 of 1", arguments(beta2=1.0), r"beta2 must be in \[0, 1\)"),
        ("rows without columns", arguments(row_positions=torch.zeros(4, dtype=torch.int64)),
         "row_positions and column_positions must be given together"),
        ("positions too few", arguments(row_positions=torch.zeros(4, dtype=torch.int64),
                                        column_positions=torch.zeros(7, dtype=torch.int64)),
         r"\(4 and 7 entries\) do not cover entries 0 to 32"),
        ("positions 2D", arguments(row_positions=torch.zeros(4, 1, dtype=torch.int64),
                                   column_positions=torch.zeros(8, dtype=torch.int64)),
         "row_positions must be a contiguous 1D int64 tensor"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())), ids=[case for case, _, _ in _bad_calls()])
def test_bad_arguments_are_refused_by_name_before_anything_changes(case: int) -> None:
    _, call, message = _bad_calls()[case]
    before = {name: value.clone() for name, value in call.items() if isinstance(value, torch.Tensor)}
    with pytest.raises(ValueError, match=message):
        submodule(load_cpu_variant(), "_ops").ops.adamw_rounded_(*call.values())
    assert all(torch.equal(value, call[name]) for name, value in before.items())
