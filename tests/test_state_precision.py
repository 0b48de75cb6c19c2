"""`state_dtype` bfloat16 and "int8": moments stored in fewer bytes with stochastic rounding, against float64 truths
(the two neighbours of each value, the float32-state run) and through checkpoints and changes of form."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from kernel_under_test import load_fallback_variant, optimizer, submodule

Muon = optimizer.Muon
state_precision = submodule(optimizer, "state_precision")
MOMENT_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")


def bfloat16_neighbours(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 values just below and just above each float32 value, in float64 (equal where it is one)."""
    down = torch.where(values.to(torch.bfloat16).double() > values.double(),
                       torch.nextafter(values.to(torch.bfloat16), torch.tensor(-torch.inf, dtype=torch.bfloat16)),
                       values.to(torch.bfloat16)).double()
    up = torch.where(down < values.double(),
                     torch.nextafter(down.to(torch.bfloat16), torch.tensor(torch.inf, dtype=torch.bfloat16)).double(),
                     down)
    return down, up


def stochastic_roundings(values: torch.Tensor, counts: int) -> torch.Tensor:
    """(counts, *values.shape) bfloat16 roundings of `values`, one per rounding count."""
    state = torch.empty(values.shape, dtype=torch.bfloat16)
    results = []
    for count in range(counts):
        state_precision.store_(["exp_avg"], [state], [None], [values], [torch.tensor(count)], torch.ones(1), [None])
        results.append(state.clone())
    return torch.stack(results)


def int8_roundtrips(key: str, values: torch.Tensor, counts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts, *values.shape) float64 values of "int8" storings of `values`, and the last storing's scales."""
    codes = torch.empty(values.shape, dtype=torch.int8)
    scales = torch.empty(state_precision.scales_shape(values.shape))
    results = []
    for count in range(counts):
        state_precision.store_([key], [codes], [scales], [values], [torch.tensor(count)], torch.ones(1), [None])
        results.append(state_precision.working_copy(key, codes, scales).double())
    return torch.stack(results), scales


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased() -> None:
    values = torch.randn(2000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 2000)
    rounded = stochastic_roundings(values, 512).double()
    down, up = bfloat16_neighbours(values)
    assert torch.all((rounded == down) | (rounded == up))
    # Each rounding is down or up with the probabilities that make its mean the value: the mean of 512 is within
    # 5 standard errors (half a spacing / sqrt(512)) of it. Round-to-nearest would be off by up to half a spacing.
    spacing = (up - down).clamp(min=torch.finfo(torch.float32).tiny)
    error = (rounded.mean(dim=0) - values.double()).abs() / spacing
    assert error.max() < 5 * 0.5 / 512 ** 0.5, error.max()
    fraction = (values.double() - down) / spacing  # the chance of rounding up
    both_likely = (fraction > 0.05) & (fraction < 0.95)  # then each neighbour has > 1 - 0.95^512 of being reached
    assert both_likely.sum() > 1000
    assert ((rounded == up).any(dim=0) & (rounded == down).any(dim=0))[both_likely].all()


def test_values_bfloat16_holds_are_stored_exactly() -> None:
    values = torch.randn(1000).bfloat16().float()
    values[:4] = torch.tensor([0.0, -0.0, torch.inf, -torch.inf])
    rounded = stochastic_roundings(values, 8)
    assert torch.equal(rounded.float(), values.expand(8, -1))


def blocks_with_outliers(rows: int, seed: int = 0) -> torch.Tensor:
    """(rows, 3 blocks and a partial one) values spanning 1e-4..1e2 within each block."""
    generator = torch.Generator().manual_seed(seed)
    columns = 3 * state_precision.BLOCK + 40
    return torch.randn(rows, columns, generator=generator) * torch.logspace(-4, 2, columns)[torch.randperm(
        columns, generator=generator)]


@pytest.mark.parametrize("key", ["momentum_buffer", "exp_avg", "exp_avg_sq"])
def test_int8_storing_is_unbiased_and_within_one_code_step(key: str) -> None:
    values = blocks_with_outliers(8)
    if key == "exp_avg_sq":
        values = values.square()  # stored as square roots: their roundings are unbiased, not the squares'
    stored, scales = int8_roundtrips(key, values, 256)
    truth = values.double()
    roots = (stored.sqrt(), truth.sqrt()) if key == "exp_avg_sq" else (stored, truth)
    # A stored value is a code times its block's scale. Muon's momentum: integer codes, the scale the block's largest
    # magnitude / 127, so codes are one scale apart. AdamW's moments: e4m3 codes (of the roots, for the second), the
    # scale the block's largest / 448; e4m3 keeps 3 mantissa bits, so codes are at most 2^-3 of the value apart, and
    # below its smallest normal, 2^-6, they are 2^-9 apart.
    unit = scales.repeat_interleave(state_precision.BLOCK, dim=-1)[..., :values.shape[-1]].double()
    if key == "momentum_buffer":
        step = unit
        torch.testing.assert_close(scales.double(), _block_maxima(values) / 127)
    else:
        step = torch.maximum(2.0 ** -3 * roots[1].abs(), 2.0 ** -9 * unit)
    assert ((roots[0] - roots[1]).abs() <= step).all()
    error = (roots[0].mean(dim=0) - roots[1]).abs() / step
    assert error.max() < 5 * 0.5 / 256 ** 0.5, error.max()


def _block_maxima(values: torch.Tensor) -> torch.Tensor:
    blocks = torch.nn.functional.pad(values, (0, -values.shape[-1] % state_precision.BLOCK))
    return blocks.view(*values.shape[:-1], -1, state_precision.BLOCK).abs().amax(dim=-1).double()


def test_int8_scales_follow_each_block() -> None:
    values = blocks_with_outliers(4)
    values[1, 300] = 1e6  # one huge entry: only its own block's scale sees it
    _, scales = int8_roundtrips("momentum_buffer", values, 1)
    torch.testing.assert_close(scales.double(), _block_maxima(values) / 127)
    assert scales.shape == (4, 4) and scales[1].argmax() == 1
    for key, moment in (("exp_avg", values), ("exp_avg_sq", values.square())):
        _, e4m3_scales = int8_roundtrips(key, moment, 1)
        torch.testing.assert_close(e4m3_scales.double(), _block_maxima(values) / 448)


def train(param: torch.Tensor, steps: int, seed: int = 0, **options) -> Muon:
    """`steps` steps of Muon on `param` and two AdamW tensors beside it: a matrix and a vector (whose moments
    "int8" keeps in bfloat16)."""
    beside = [torch.zeros(8, param.shape[-1], dtype=param.dtype), torch.zeros(param.shape[-1], dtype=param.dtype)]
    if isinstance(param, torch.nn.Parameter):  # DCP's state-dict helpers name a module's parameters only
        beside = [torch.nn.Parameter(tensor) for tensor in beside]
    opt = Muon([dict(params=[param]), dict(params=beside, use_muon=False)], lr=0.02, **options)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for tensor in all_params(opt):
            tensor.grad = torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
        opt.step()
    return opt


def adamw_trained(package, start: torch.Tensor, steps: int, state_dtype) -> tuple[torch.Tensor, dict]:
    """A copy of `start` after `steps` AdamW steps of `package`'s Muon (seeded gradients), and its state."""
    param = start.clone()
    opt = package.Muon([dict(params=[param], use_muon=False)], lr=0.02, state_dtype=state_dtype)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        param.grad = torch.randn(param.shape, generator=generator)
        opt.step()
    return param, opt.state[param]


def all_params(opt: Muon) -> list[torch.Tensor]:
    return [param for group in opt.param_groups for param in group["params"]]


def state_bytes(opt: Muon, param: torch.Tensor) -> int:
    return sum(value.numel() * value.element_size() for key, value in opt.state[param].items()
               if key.removesuffix("_codes") in MOMENT_KEYS or key.endswith("_scale"))


@pytest.mark.parametrize("state_dtype,muon_bytes,adamw_bytes", [
    (None, 4, 8), (torch.bfloat16, 2, 4), ("int8", 1 + 4 / 256, 2 * (1 + 4 / 256))])
def test_moment_bytes_per_parameter(state_dtype, muon_bytes: float, adamw_bytes: float) -> None:
    opt = train(torch.randn(16, 512), 1, state_dtype=state_dtype)
    muon, adamw, vector = all_params(opt)
    assert state_bytes(opt, muon) / muon.numel() == muon_bytes
    assert state_bytes(opt, adamw) / adamw.numel() == adamw_bytes
    assert state_bytes(opt, vector) / vector.numel() == (4 if state_dtype == "int8" else adamw_bytes)


# Measured over 20 steps (seed 1): the largest entry of |ours - float32 state's| as a fraction of the largest entry
# of the float32 run's own move: bfloat16 0.5%; int8 1.3% (Muon's linear codes) and 14% (AdamW's matrix, e4m3 codes
# with 3 mantissa bits, on gradients of pure noise). A lost moment moves entries by the whole move.
FORMS = [(torch.bfloat16, 0.02), ("int8", 0.25)]


@pytest.mark.parametrize("state_dtype,tolerance", FORMS)
def test_training_stays_near_the_float32_state_run(state_dtype, tolerance: float) -> None:
    weight = torch.randn(32, 48, generator=torch.Generator().manual_seed(1))
    fp32_state, ours = weight.clone(), weight.clone()
    truth = train(fp32_state, 20)
    opt = train(ours, 20, state_dtype=state_dtype)
    for param in all_params(opt):
        assert int(opt.state[param]["rounding_count"]) == 20
    moved = (fp32_state - weight).abs().max()
    assert (ours - fp32_state).abs().max() < tolerance * moved
    for param, reference in zip(all_params(opt)[1:], all_params(truth)[1:]):  # AdamW's parameters too
        assert (param - reference).abs().max() < tolerance * reference.abs().max()


@pytest.mark.parametrize("build", ["compiled", "fallback"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"])
def test_adamw_steps_stay_bounded_when_a_block_spans_many_magnitudes(state_dtype, build: str) -> None:
    # Gradients of 1e3 beside 1e-2 in one block: the small entries' second moments fall below the smallest 8-bit
    # code (relative to the block's largest) and round to zero now and then; their first moments must then not
    # step by m / eps. An AdamW step moves an entry by about lr at most, and at most ~lr * 3 here. The fallback
    # build (as GPUs) steps the moments through torch's fused AdamW, the compiled one through its own op.
    package = optimizer if build == "compiled" else load_fallback_variant()
    param = torch.zeros(4, 512)
    opt = package.Muon([dict(params=[param], use_muon=False)], lr=0.01, weight_decay=0.0, state_dtype=state_dtype)
    grad = torch.full((4, 512), 1e-2)
    grad[:, ::256] = 1e3
    for _ in range(30):
        before = param.clone()
        param.grad = grad * torch.randn(4, 512, generator=torch.Generator().manual_seed(len(opt.state)))
        opt.step()
        assert (param - before).abs().max() < 3 * 0.01


def test_a_constant_small_gradient_keeps_moving_the_momentum() -> None:
    # beta 0.95 toward 1.001 from 1.0: each step adds 5e-5 of a gap whose bfloat16 spacing is 7.8e-3, so nearest
    # rounding would leave every entry at 1.0 forever. Stochastic rounding keeps their mean on the float64 path.
    param = torch.zeros(64, 64)
    opt = Muon([param], lr=0.0, momentum=0.95, state_dtype=torch.bfloat16)
    opt.state[param]["momentum_buffer"] = torch.ones(64, 64, dtype=torch.bfloat16)
    expected = torch.tensor(1.0, dtype=torch.float64)
    for _ in range(200):
        param.grad = torch.full((64, 64), 1.001)
        opt.step()
        expected = 0.95 * expected + 0.05 * torch.tensor(1.001, dtype=torch.float32).double()
    buffer = opt.state[param]["momentum_buffer"].double()
    # Each entry is 1.0 or 1.0078 at random, 1.0078 about 13% of the time: the mean of 4096 has a standard error of
    # 4e-5, so it is within 2e-4 (5 errors); nearest rounding would be off by 1e-3.
    assert abs(buffer.mean() - expected) < 2e-4, (buffer.mean(), expected)
    assert set(buffer.unique().tolist()) <= {1.0, 1.0078125}


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"])
def test_adamw_in_small_chunks_equals_adamw_in_one(state_dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the compiled `adamw_rounded_` (the fallback build; GPUs) the AdamW moments are stepped ROUNDED_CHUNK
    # entries at a time (whole lines of 8-bit codes): the random bits follow each entry's index, so where the chunks
    # end changes nothing. Every chunk here is a multiple of 64 entries (2 lines of 320, or 704 entries), as torch's
    # fused AdamW rounds its vector body and its scalar tail differently (a fused multiply-add or not).
    fallback = load_fallback_variant()
    start = torch.randn(8, 320)
    whole, whole_state = adamw_trained(fallback, start, 3, state_dtype)
    monkeypatch.setattr(submodule(fallback, "functional"), "ROUNDED_CHUNK", 704)
    chunked, chunked_state = adamw_trained(fallback, start, 3, state_dtype)
    assert torch.equal(whole, chunked)
    for key, value in whole_state.items():
        assert torch.equal(chunked_state[key], value), key


# float64 parameters' rounded moments step through torch's fused AdamW (on float64 copies), float32 ones through the
# compiled op: each path leaves a skipped parameter, its moments and its counts as they were.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"])
def test_a_nonfinite_gradient_changes_no_state(state_dtype, dtype: torch.dtype) -> None:
    param = torch.randn(12, 16, dtype=dtype)
    opt = train(param, 2, state_dtype=state_dtype)
    before = [{key: value.clone() for key, value in opt.state[p].items()} for p in all_params(opt)]
    params_before = [p.clone() for p in all_params(opt)]
    for p in all_params(opt):
        p.grad = torch.randn(p.shape, dtype=dtype)
        p.grad[0, ...] = float("nan")  # in one block of each tensor: no other block, no scale may change
    opt.step()
    for p, start in zip(all_params(opt), params_before):
        assert torch.equal(p, start)
    for p, saved in zip(all_params(opt), before):
        for key, value in saved.items():
            if key != "nonfinite_skips":  # which counts this step
                assert torch.equal(opt.state[p][key], value), key
        assert int(opt.state[p]["nonfinite_skips"]) == 1


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"])
def test_a_checkpoint_saves_the_moments_as_they_are_and_resumes_exactly(state_dtype) -> None:
    through = torch.randn(10, 14)
    first = through.clone()
    train(through, 6, state_dtype=state_dtype)
    opt = train(first, 3, state_dtype=state_dtype)
    saved = opt.state_dict()
    stored = {(key, value.dtype) for state in saved["state"].values() for key, value in state.items()
              if key.removesuffix("_codes") in MOMENT_KEYS}
    # 8-bit codes under keys of their own, the vector's moments (and every moment of bfloat16 state) under theirs.
    assert stored == {("momentum_buffer_codes", torch.int8), ("exp_avg_codes", torch.int8),
                      ("exp_avg_sq_codes", torch.int8), ("exp_avg", torch.bfloat16), ("exp_avg_sq", torch.bfloat16)
                      } if state_dtype == "int8" else {(key, torch.bfloat16) for key in MOMENT_KEYS}
    copies = [p.clone() for p in all_params(opt)]
    copies[0] = first.clone()
    resumed = Muon([dict(params=copies[:1]), dict(params=copies[1:], use_muon=False)], lr=0.02)
    resumed.load_state_dict(saved)  # the groups' state_dtype comes back with them
    assert resumed.param_groups[0]["state_dtype"] == state_dtype
    for p, original in zip(copies, all_params(opt)):
        for key, value in opt.state[original].items():
            assert torch.equal(resumed.state[p][key], value) and resumed.state[p][key].dtype == value.dtype
    generator = torch.Generator().manual_seed(0)
    for step in range(6):  # the same gradient stream as `train`'s
        grads = [torch.randn(p.shape, generator=generator) for p in copies]
        if step >= 3:
            for p, grad in zip(copies, grads):
                p.grad = grad
            resumed.step()
    assert torch.equal(copies[0], through)


@pytest.mark.parametrize("start,switch_to", [(None, torch.bfloat16), (torch.bfloat16, None), (None, "int8"),
                                             ("int8", None), ("int8", torch.bfloat16)])
def test_the_moments_follow_a_change_of_state_dtype(start, switch_to) -> None:
    opt = train(torch.randn(8, 300), 2, state_dtype=start)
    values = {p: working_copy(opt, p, "momentum_buffer" if i == 0 else "exp_avg")
              for i, p in enumerate(all_params(opt))}
    for group in opt.param_groups:
        group["state_dtype"] = switch_to
    for p in all_params(opt):
        p.grad = torch.zeros_like(p)
    opt.step()
    for i, p in enumerate(all_params(opt)):
        key = "momentum_buffer" if i == 0 else "exp_avg"
        form = torch.bfloat16 if switch_to == "int8" and p.ndim < 2 else switch_to  # "int8" keeps vectors in bf16
        expected = {None: torch.float32, torch.bfloat16: torch.bfloat16, "int8": torch.int8}[form]
        stored, scales = state_precision.stored_moment(opt.state[p], key)
        assert stored.dtype == expected and (scales is not None) == (form == "int8")
        # A zero gradient: the Muon momentum shrinks by its beta, AdamW's first moment by beta1, then each is
        # stored in its new form, twice (converted, then stepped): within two of that form's steps.
        beta = 0.95 if i == 0 else 0.9
        largest = values[p].abs().amax()
        if form == "int8" and key == "momentum_buffer":  # linear codes: 1/127 of a block's largest apart
            rtol, atol = 0.0, 2 * largest / 127
        else:  # floating codes: 2^-20 (float32), 2^-7 (bfloat16), 2^-3 (e4m3) of the value apart
            rtol = 2 * {None: 2.0 ** -20, torch.bfloat16: 2.0 ** -7, "int8": 2.0 ** -3}[form]
            atol = rtol * largest / 128
        torch.testing.assert_close(working_copy(opt, p, key), beta * values[p], rtol=rtol, atol=atol)


def dcp_round_trip(saved: Muon, loading: Muon, path: Path, options: StateDictOptions | None = None) -> None:
    """`saved`'s state into `loading` through torch.distributed.checkpoint, as a training loop resumes (one process,
    no process group): `loading`'s own state dict is the template DCP loads into."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # as it should be here
        dcp.save({"optimizer": get_optimizer_state_dict(_Parameters(all_params(saved)), saved, options=options)},
                 checkpoint_id=path)
        holder = _Parameters(all_params(loading))
        state = {"optimizer": get_optimizer_state_dict(holder, loading, options=options)}
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(holder, loading, state["optimizer"], options=options)


class _Parameters(torch.nn.Module):
    """The module DCP's state-dict helpers name parameters by."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(params)


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"])
def test_dcp_resumes_exactly(state_dtype, flatten: bool, tmp_path: Path) -> None:
    # flatten_optimizer_state_dict=True (torchtitan's) rebuilds each parameter's state from the live state's keys.
    start = torch.randn(8, 300)
    saved = train(torch.nn.Parameter(start.clone()), 2, state_dtype=state_dtype)
    resumed = train(torch.nn.Parameter(start.clone()), 1, seed=1, state_dtype=state_dtype)
    dcp_round_trip(saved, resumed, tmp_path, StateDictOptions(flatten_optimizer_state_dict=flatten))
    for p, q in zip(all_params(resumed), all_params(saved)):
        assert resumed.state[p].keys() == saved.state[q].keys()
        for key, value in saved.state[q].items():
            assert resumed.state[p][key].dtype == value.dtype and torch.equal(resumed.state[p][key], value), key


@pytest.mark.parametrize("saved_as,loaded_as", [("int8", None), ("int8", torch.bfloat16), (None, "int8")])
def test_dcp_refuses_a_checkpoint_of_another_form_rather_than_loading_codes_as_values(saved_as, loaded_as,
                                                                                     tmp_path: Path) -> None:
    # DCP loads into the optimizer's own state, cast to its dtypes: 8-bit codes kept under the moment's own key
    # loaded into float32 state as values (a momentum a million times its size), and their scales were dropped.
    saved = train(torch.nn.Parameter(torch.randn(8, 300)), 2, state_dtype=saved_as)
    loading = train(torch.nn.Parameter(torch.randn(8, 300)), 1, state_dtype=loaded_as)
    with pytest.raises(CheckpointException, match="Missing key in checkpoint"):
        dcp_round_trip(saved, loading, tmp_path)


def test_codes_saved_under_their_moments_own_key_still_load() -> None:
    """Checkpoints of versions that kept 8-bit codes under the moment's own key (before 2026-11-27)."""
    opt = train(torch.randn(8, 300), 2, state_dtype="int8")
    saved = opt.state_dict()
    old_form = {**saved, "state": {index: {key.removesuffix("_codes"): value for key, value in state.items()}
                                   for index, state in saved["state"].items()}}
    resumed = train(torch.randn(8, 300), 1, state_dtype="int8")
    resumed.load_state_dict(old_form)
    for p, q in zip(all_params(resumed), all_params(opt)):
        assert resumed.state[p].keys() == opt.state[q].keys()
        for key, value in opt.state[q].items():
            assert torch.equal(resumed.state[p][key], value), key


@pytest.mark.parametrize("saved_as,switch_to", [("int8", None), ("int8", torch.bfloat16), (None, "int8")])
def test_a_state_dtype_change_between_runs_through_dcp(saved_as, switch_to, tmp_path: Path) -> None:
    """The README's way: resume with the saved state_dtype, then change it (converted at the next step): the same
    parameters and state as loading the optimizer's own state dict in memory, bit for bit."""
    start = torch.randn(8, 300)
    saved = train(torch.nn.Parameter(start.clone()), 2, state_dtype=saved_as)
    through_dcp = train(torch.nn.Parameter(start.clone()), 1, seed=1, state_dtype=saved_as)
    dcp_round_trip(saved, through_dcp, tmp_path)
    in_memory = train(torch.nn.Parameter(start.clone()), 1, seed=1, state_dtype=saved_as)
    in_memory.load_state_dict(saved.state_dict())
    for opt in (through_dcp, in_memory):
        for group in opt.param_groups:
            group["state_dtype"] = switch_to
        for p, q in zip(all_params(opt), all_params(saved)):
            with torch.no_grad():
                p.copy_(q)
            p.grad = torch.ones_like(p)
        opt.step()
    for p, q in zip(all_params(through_dcp), all_params(in_memory)):
        assert torch.equal(p, q)
        assert through_dcp.state[p].keys() == in_memory.state[q].keys()
        for key, value in in_memory.state[q].items():
            assert torch.equal(through_dcp.state[p][key], value) and through_dcp.state[p][key].dtype == value.dtype


def working_copy(opt: Muon, param: torch.Tensor, key: str) -> torch.Tensor:
    state = opt.state[param]
    return state_precision.working_copy(key, *state_precision.stored_moment(state, key))


def test_bfloat16_parameters_with_bfloat16_state() -> None:
    # Small weights, so that bfloat16 parameters can hold a step's change (about 7e-3 per entry here).
    weight = 0.05 * torch.randn(16, 24)
    bf16_param = weight.bfloat16()
    opt = train(bf16_param, 5, state_dtype=torch.bfloat16)
    fp32_param = weight.clone()
    train(fp32_param, 5)
    assert all(p.dtype == torch.bfloat16 for p in opt.param_groups[0]["params"])
    # Each step rounds the parameters to bfloat16 (spacing <= 2^-10 here): a few such roundings and their effect on
    # the later steps (we measured 3.5e-3 to 5.4e-3), against a move of ~0.045 over the five steps.
    assert (bf16_param.float() - fp32_param).abs().max() < 0.01


def test_an_unsupported_state_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Invalid state_dtype: torch.float16 \(expected one of None, torch.bfloat16, "
                                         "'int8'"):
        Muon([torch.randn(4, 8)], state_dtype=torch.float16)


@pytest.fixture(scope="module")
def quality():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import quality as harness
    return harness


def test_the_demo_trains_as_well_with_bfloat16_and_int8_state(quality) -> None:
    """300 steps of the demo GPT (the quality harness's runs: Muon at its best lr there, seed 0) with each state
    form: the final held-out loss is within 2% of the float32-state run's."""
    options = argparse.Namespace(steps=300, evals=2)
    losses = {variant: quality.run_one(optimizer, options, variant, lr=1e-2, seed=0)["val_losses"][-1]
              for variant in ("muon", "muon-bf16-state", "muon-int8-state")}
    for variant in ("muon-bf16-state", "muon-int8-state"):
        assert abs(losses[variant] - losses["muon"]) <= 0.02 * losses["muon"], losses


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"], ids=str)
def test_a_float64_adamw_parameter_keeps_its_precision_with_rounded_moments(state_dtype) -> None:
    # The rounded-moment AdamW step worked on float32 copies of the parameter and gradient: every step rounded a
    # float64 parameter to float32 (an lr=0 step moved 1 + 1e-12 by 1e-12), and a gradient beyond float32's range
    # became inf and the parameter NaN, no skip counted.
    param = torch.full((4, 256), 1 + 1e-12, dtype=torch.float64)
    opt = Muon([dict(params=[param], use_muon=False)], lr=0.0, weight_decay=0.0, state_dtype=state_dtype)
    param.grad = torch.randn(param.shape, dtype=torch.float64)
    opt.step()
    assert torch.equal(param, torch.full_like(param, 1 + 1e-12))
    opt.param_groups[0]["lr"] = 1e-3
    param.grad = torch.randn(param.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 1e39
    opt.step()
    assert torch.isfinite(param).all() and opt.nonfinite_skips() == 0
