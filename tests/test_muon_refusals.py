"""What Muon refuses, and that a refused step or load changes nothing: options given in a form that means something
else (0 for False, a string for a bool, a constructor option in a group), gradients that autograd would not make,
group changes that only a later group's state reveals as invalid, and checkpoints whose moments cannot be read as
saved. Also the forms of a valid option that mean what they say (numpy integers, a group's None)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from kernel_under_test import optimizer, submodule

Muon = optimizer.Muon


def seeded_grads(params: list[torch.Tensor], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)


def snapshot(opt: "optimizer.Muon", params: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, Any]]:
    return [param.detach().clone() for param in params], copy.deepcopy(opt.state_dict())


def assert_unchanged(opt: "optimizer.Muon", params: list[torch.Tensor],
                     before: tuple[list[torch.Tensor], dict[str, Any]]) -> None:
    after = snapshot(opt, params)
    assert all(torch.equal(param, old) for param, old in zip(after[0], before[0]))
    assert after[1]["state"].keys() == before[1]["state"].keys()
    for index, state in before[1]["state"].items():
        assert state.keys() == after[1]["state"][index].keys()
        for key, value in state.items():
            got = after[1]["state"][index][key]
            assert got.dtype == value.dtype and torch.equal(got, value), (index, key)


def two_groups_after_a_step(last: dict[str, Any] | None = None) -> tuple["optimizer.Muon", list[torch.Tensor]]:
    """A matrix and a vector in each of two groups, one step taken; `last`: the second group's own options."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(8, 6, generator=generator), torch.randn(6, generator=generator),
              torch.randn(6, 8, generator=generator), torch.randn(4, generator=generator)]
    opt = Muon([dict(params=params[:2]), dict(params=params[2:], **(last or {}))], lr=0.02)
    seeded_grads(params, 0)
    opt.step()
    seeded_grads(params, 1)
    return opt, params


@pytest.mark.parametrize("option, value", [("nesterov", "yes"), ("nesterov", None), ("nesterov", 1),
                                           ("use_muon", 0), ("use_muon", np.False_), ("use_muon", "auto")])
def test_a_bool_option_in_another_form_is_refused_wherever_it_enters(option: str, value: Any) -> None:
    # `use_muon=0` passed an equality check and then routed as a forced Muon (`is False` failed); nesterov="yes"
    # reached the momentum op after the first group's update had been written.
    with pytest.raises(ValueError, match=option):
        Muon([dict(params=[torch.randn(4, 4)], **{option: value})])  # use_muon is a group key only
    opt, params = two_groups_after_a_step()
    with pytest.raises(ValueError, match=option):
        opt.add_param_group({"params": [torch.randn(3, 3)], option: value})
    assert len(opt.param_groups) == 2
    opt.param_groups[-1][option] = value
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=option):
        opt.step()
    assert_unchanged(opt, params, before)


@pytest.mark.parametrize("key, value", [("offload", "cpu"), ("qk_clip_threshold", -1.0), ("process_group", None),
                                        ("qk_clip", {})])
def test_an_option_of_the_whole_optimizer_is_refused_in_a_group(key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"{key}.*whole optimizer"):
        Muon([dict(params=[torch.randn(4, 4)], **{key: value})])


@pytest.mark.parametrize("flag", ["maximize", "amsgrad", "differentiable"])
def test_a_torch_flag_muon_does_not_implement_is_refused_in_a_group_however_it_enters(flag: str) -> None:
    """torch.optim.AdamW honours these as group keys; ours took them and stepped without them (maximize=True went
    downhill). Switched off, as a torch optimizer's state dict carries them, they are accepted."""
    param = torch.randn(4, 4)
    param.grad = torch.randn(4, 4)
    with pytest.raises(ValueError, match=f"Invalid {flag}: True .Muon does not support {flag}"):
        Muon([dict(params=[torch.randn(4, 4)], **{flag: True})])
    Muon([dict(params=[torch.randn(4, 4)], **{flag: False})])
    opt = Muon([param])
    opt.step()
    saved, before = opt.state_dict(), param.clone()
    saved["param_groups"][0][flag] = True
    with pytest.raises(ValueError, match=f"Invalid {flag}: True"):
        opt.load_state_dict(saved)
    opt.param_groups[0][flag] = True  # a key added between steps
    with pytest.raises(ValueError, match=f"Invalid {flag}: True"):
        opt.step()
    opt.param_groups[0][flag] = False
    opt.step()  # and switched on again in the group that holds it
    before = param.clone()
    opt.param_groups[0][flag] = True
    with pytest.raises(ValueError, match=f"Invalid {flag}: True"):
        opt.step()
    assert torch.equal(param, before)


def test_a_group_whose_warning_is_raised_as_an_error_is_not_added(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under warnings-as-errors (`pytest -W error`) the slow-dtype warning raises: the group stayed in the optimizer,
    and adding it again failed as a duplicate."""
    muon = submodule(optimizer, "muon")
    monkeypatch.setattr(muon, "warn_if_slow", lambda dtype, device: warnings.warn(f"{dtype} is slow on {device}"))
    opt = Muon([torch.randn(4, 4)])
    group = {"params": [torch.randn(8, 8)], "ns_dtype": torch.float16}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="is slow on cpu"):
            opt.add_param_group(dict(group))
    assert len(opt.param_groups) == 1
    opt.add_param_group(group)
    assert len(opt.param_groups) == 2


def test_a_group_given_none_for_adamw_lr_scale_or_betas_takes_what_none_stands_for() -> None:
    # The constructor's None means 1 and (0.9, 0.95); a group's None means the same, where it was refused.
    def trained(group: dict[str, Any]) -> list[torch.Tensor]:
        params = [torch.randn(8, 6, generator=torch.Generator().manual_seed(2)), torch.ones(6)]
        opt = Muon([torch.zeros(3, 3)], lr=0.02, adamw_lr_scale=0.5, adamw_betas=(0.8, 0.9))
        opt.add_param_group({"params": params, **group})
        for seed in range(2):
            seeded_grads(params, seed)
            opt.step()
        return params

    expected = trained({"adamw_lr_scale": 1.0, "adamw_betas": (0.9, 0.95)})
    got = trained({"adamw_lr_scale": None, "adamw_betas": None})
    assert all(torch.equal(p, q) for p, q in zip(got, expected))


def test_numpy_and_tensor_integers_are_taken_as_their_values() -> None:
    def trained(**options: Any) -> list[torch.Tensor]:
        params = [torch.randn(8, 6, generator=torch.Generator().manual_seed(3))]
        opt = Muon(params, lr=0.02, **options)
        seeded_grads(params, 0)
        opt.step()
        return params

    expected = trained(ns_steps=3, chunk_size=2, qk_clip_threshold=50.0)
    for options in (dict(ns_steps=np.int64(3), chunk_size=np.int32(2), qk_clip_threshold=np.float32(50.0)),
                    dict(ns_steps=torch.tensor(3), chunk_size=torch.tensor(2), qk_clip_threshold=torch.tensor(50.0))):
        assert torch.equal(trained(**options)[0], expected[0])
    for option, value in (("ns_steps", torch.tensor(3.0)), ("ns_steps", np.float64(3)), ("chunk_size", 2.5),
                          ("qk_clip_threshold", "50")):
        with pytest.raises(ValueError, match=option):
            Muon([torch.randn(4, 4)], **{option: value})


def test_a_number_in_a_form_not_taken_is_refused_by_its_type() -> None:
    # A 0-dim numpy array prints as its number: "Invalid learning rate: 0.01" alone said nothing.
    with pytest.raises(ValueError, match="learning rate: 0.01 .*not a ndarray"):
        Muon([torch.randn(4, 4)], lr=np.array(0.01))


@pytest.mark.parametrize("held", [False, True], ids=["first-step", "held-items"])
@pytest.mark.parametrize("routed_to", ["muon", "adamw"])
@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_a_gradient_autograd_would_not_make_is_refused_before_any_update(routed_to: str, bad: str,
                                                                         held: bool) -> None:
    # Put in through .data, a gradient of another shape or dtype on an AdamW-routed parameter was refused only by
    # the AdamW part's op, after the Muon part had written its updates.
    params = [torch.randn(8, 6), torch.randn(6)]
    opt = Muon(params, lr=0.02)
    if held:  # a step before: the next one takes the items it held, with the new gradients
        seeded_grads(params, 2)
        opt.step()
    seeded_grads(params, 0)
    target = params[0] if routed_to == "muon" else params[1]
    wrong = torch.randn(2, *target.shape) if bad == "shape" else torch.randn(target.shape, dtype=torch.float64)
    target.grad.data = wrong
    before = snapshot(opt, params)
    with pytest.raises(RuntimeError, match="Invalid gradient"):
        opt.step()
    assert_unchanged(opt, params, before)


@pytest.mark.parametrize("change", ["normalization", "use_muon"])
def test_a_later_group_refused_by_its_state_or_shapes_leaves_the_earlier_groups_state_as_it_was(change: str) -> None:
    # The first group's moments are due to go to int8 at this step; the second group is invalid in a way only its
    # parameters or state show. Checked as the groups' state was prepared, the first group's moments had been
    # converted (a float32 momentum through int8 codes: 0.7% off once converted back) before the refusal.
    opt, params = two_groups_after_a_step({"normalization": "neuron"})
    opt.param_groups[0]["state_dtype"] = "int8"
    if change == "normalization":
        opt.param_groups[1]["normalization"] = "element"  # its saved second moment has the "neuron" shape
    else:
        opt.param_groups[1]["use_muon"] = True  # it holds a vector
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=change):
        opt.step()
    assert_unchanged(opt, params, before)


@pytest.mark.parametrize("routed_to", ["muon", "adamw"])
@pytest.mark.parametrize("grad", ["kept", "resized"])
def test_a_parameter_resized_in_place_is_refused_before_any_update(routed_to: str, grad: str) -> None:
    # `param.data = ...` of another shape after a step: the items held from that step still held (their gradient's
    # shape had not changed), and a kernel refused the parameter after the first group's update had been written.
    opt, params = two_groups_after_a_step()
    target = params[2] if routed_to == "muon" else params[3]
    target.data = torch.randn(*target.shape[:-1], target.shape[-1] + 1)
    if grad == "resized":
        target.grad = torch.randn(target.shape)
    before = snapshot(opt, params)
    with pytest.raises(RuntimeError, match="Invalid (gradient|state)"):
        opt.step()
    assert_unchanged(opt, params, before)
    del opt.state[target]  # as the message says: its state restarts, and the step goes through
    target.grad = torch.randn(target.shape)
    opt.step()
    assert opt.state[target]["momentum_buffer" if routed_to == "muon" else "exp_avg"].shape == target.shape


@pytest.mark.parametrize("option", ["ns_dtype", "comm_dtype"])
def test_a_dtype_products_cannot_run_in_is_refused(option: str) -> None:
    # float8 passed as "a floating dtype", and the step failed in the momentum op after creating state.
    with pytest.raises(ValueError, match=option):
        Muon([torch.randn(4, 4)], **{option: torch.float8_e4m3fn})
    opt, params = two_groups_after_a_step()
    opt.param_groups[1][option] = torch.float8_e5m2
    opt.param_groups[0]["state_dtype"] = "int8"  # due to convert the first group's momentum at this step
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=option):
        opt.step()
    assert_unchanged(opt, params, before)
    with pytest.raises(ValueError, match="dtype"):
        optimizer.zeropower(torch.randn(4, 4), dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("spelling, ours", [({"adamw_betas": None}, {"adamw_betas": (0.9, 0.95)}),
                                            ({"adamw_lr_scale": None}, {"adamw_lr_scale": 1.0}),
                                            ({"betas": (0.8, 0.9)}, {"adamw_betas": (0.8, 0.9)}),
                                            ({"fallback_lr_scale": 0.5}, {"adamw_lr_scale": 0.5}),
                                            ({"adamw_lr": 0.01}, {"adamw_lr_scale": 0.5}),
                                            ({"algo": "adamuon"}, {"normalization": "element"}),
                                            ({"adjust_lr_fn": "rms_to_rms"}, {"adjust_lr_fn": "spectral"})])
def test_a_group_key_set_between_steps_means_what_it_means_where_groups_enter(spelling: dict[str, Any],
                                                                              ours: dict[str, Any]) -> None:
    # Set between steps, a None stood refused ("Invalid adamw_betas: None"), and timm's keys and adamw_lr were kept
    # and never read.
    def trained(change: dict[str, Any]) -> list[torch.Tensor]:
        opt, params = two_groups_after_a_step({"adamw_betas": (0.7, 0.8), "adamw_lr_scale": 2.0})
        opt.param_groups[1].update(change)
        for seed in range(2):
            seeded_grads(params, seed)
            opt.step()
        assert not set(spelling) - set(ours) & opt.param_groups[1].keys()  # kept in our spelling only
        return params

    expected = trained(ours)
    assert all(torch.equal(p, q) for p, q in zip(trained(spelling), expected))


def test_an_option_of_the_whole_optimizer_set_on_a_group_between_steps_is_refused() -> None:
    opt, params = two_groups_after_a_step()
    opt.param_groups[1]["offload"] = "cpu"
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match="offload.*whole optimizer"):
        opt.step()
    assert_unchanged(opt, params, before)


@pytest.mark.parametrize("normalization", [None, "neuron"])
def test_a_parameter_made_float64_in_place_trains_on_as_after_a_load(normalization: str | None) -> None:
    # model.double() changes each parameter's dtype in place: the items a step holds from the step before must not
    # hold then (the momentum op refused the float32 momentum), and the moments follow the new dtype as they do
    # when the same state is loaded into a fresh optimizer (a normalization's second moment stayed float32, 1.7e-9
    # from the loaded run's after three steps).
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))

    def step(net: torch.nn.Module, opt: "optimizer.Muon") -> None:
        opt.zero_grad()
        net(torch.ones(3, 8, dtype=next(net.parameters()).dtype)).square().sum().backward()
        opt.step()

    net, twin = model(), model()
    opt = Muon(net.parameters(), lr=0.01, normalization=normalization)
    step(net, opt)
    fresh = Muon(twin.parameters(), lr=0.01, normalization=normalization)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    twin.load_state_dict(net.state_dict())
    net.double()
    twin.double()
    step(net, opt)
    step(twin, fresh)
    for param, other in zip(net.parameters(), twin.parameters()):
        assert param.dtype == torch.float64 and torch.equal(param, other)
        assert opt.state[param]["exp_avg" if param.dim() == 1 else "momentum_buffer"].dtype == torch.float64
        assert "update_sq" not in opt.state[param] or opt.state[param]["update_sq"].dtype == torch.float64


def _codes_without_scales(state: dict[str, Any]) -> None:
    del state["momentum_buffer_scale"]


def _values_with_scales(state: dict[str, Any]) -> None:
    state["momentum_buffer"] = state.pop("momentum_buffer_codes").float()


def _scales_without_codes(state: dict[str, Any]) -> None:
    del state["momentum_buffer_codes"]
    state["nonfinite_skips"] = torch.zeros((), dtype=torch.int64)


def _no_moments(state: dict[str, Any]) -> None:
    del state["momentum_buffer_codes"], state["momentum_buffer_scale"]


def _integer_values(state: dict[str, Any]) -> None:
    state["momentum_buffer"] = state.pop("momentum_buffer_codes").to(torch.int32)
    del state["momentum_buffer_scale"]


def _codes_beside_values(state: dict[str, Any]) -> None:
    state["momentum_buffer"] = state["momentum_buffer_codes"].float()


def _codes_of_another_dtype(state: dict[str, Any]) -> None:
    state["momentum_buffer_codes"] = state["momentum_buffer_codes"].to(torch.uint8)


def _codes_without_rounding_count(state: dict[str, Any]) -> None:
    del state["rounding_count"]


def _second_moment_without_its_count(state: dict[str, Any]) -> None:
    del state["update_step"]


def _count_without_second_moment(state: dict[str, Any]) -> None:
    del state["update_sq"]


SPOILED = {"codes_without_scales": _codes_without_scales, "values_with_scales": _values_with_scales,
           "scales_without_codes": _scales_without_codes, "no_moments": _no_moments,
           "integer_values": _integer_values, "codes_beside_values": _codes_beside_values,
           "codes_of_another_dtype": _codes_of_another_dtype,
           "codes_without_rounding_count": _codes_without_rounding_count,
           "second_moment_without_its_count": _second_moment_without_its_count,
           "count_without_second_moment": _count_without_second_moment}


@pytest.mark.parametrize("spoil", SPOILED)
def test_a_checkpoint_whose_moments_cannot_be_read_as_saved_is_refused_and_changes_nothing(spoil: str) -> None:
    # int8 codes taken for values were read 127x too large; values with scales beside them were read as codes; state
    # without its moments restarted them from zero, codes without their count restarted their random bits, and a
    # second moment without its step count failed the next step after the momentum had been written.
    params = [torch.randn(8, 256, generator=torch.Generator().manual_seed(4))]
    source = Muon(params, lr=0.02, state_dtype="int8", normalization="neuron")
    seeded_grads(params, 0)
    source.step()
    saved = copy.deepcopy(source.state_dict())
    SPOILED[spoil](saved["state"][0])
    target = Muon(params, lr=0.02, state_dtype="int8", normalization="neuron")
    seeded_grads(params, 1)
    target.step()
    before = snapshot(target, params)
    with pytest.raises(ValueError, match="Invalid state_dict"):
        target.load_state_dict(saved)
    assert_unchanged(target, params, before)


def test_a_load_post_hook_sees_and_keeps_the_state_as_loaded() -> None:
    # The moments were restored in their saved dtypes after torch's pass had run the post-hooks: a hook saw them cast
    # to the parameter's dtype, and its own change was overwritten.
    params = [torch.randn(8, 6, dtype=torch.bfloat16), torch.randn(6, dtype=torch.bfloat16)]
    source = Muon(params, lr=0.02, state_dtype="int8")
    seeded_grads(params, 0)
    source.step()
    target = Muon([param.clone() for param in params], lr=0.02, state_dtype="int8")
    seen = {}

    def restart_the_momentum(opt: "optimizer.Muon") -> None:
        state = opt.state[opt.param_groups[0]["params"][0]]
        seen.update({key: value.dtype for key, value in state.items()})
        state["momentum_buffer_codes"].zero_()

    target.register_load_state_dict_post_hook(restart_the_momentum)
    target.load_state_dict(source.state_dict())
    loaded = target.state[target.param_groups[0]["params"][0]]
    assert seen == {key: value.dtype for key, value in source.state[params[0]].items()}
    assert not loaded["momentum_buffer_codes"].any()


# --- group keys set between steps: kept through a checkpoint, and put back by a refused step ----------------------

BETWEEN_STEPS = [{"adamw_betas": None}, {"adamw_lr_scale": None}, {"betas": (0.8, 0.9)}, {"fallback_lr_scale": 0.5},
                 {"adamw_lr": 0.01}, {"use_fallback": True}, {"algo": "adamuon"}]


@pytest.mark.parametrize("change", BETWEEN_STEPS, ids=lambda change: next(iter(change)))
def test_a_state_dict_taken_after_a_key_set_between_steps_resumes_as_the_optimizer_would(change: dict) -> None:
    # The state dict holds the key beside the one the group kept; loading it refused both names ("given with") or
    # the None, although the optimizer itself stepped on.
    opt, params = two_groups_after_a_step()
    opt.param_groups[1].update(change)
    saved = copy.deepcopy(opt.state_dict())
    resumed_params = [param.clone() for param in params]
    resumed = Muon([dict(params=resumed_params[:2]), dict(params=resumed_params[2:])], lr=0.02)
    resumed.load_state_dict(saved)
    for seed in (1, 2):
        seeded_grads(params, seed)
        seeded_grads(resumed_params, seed)
        opt.step()
        resumed.step()
    assert all(torch.equal(p, q) for p, q in zip(resumed_params, params))
    assert resumed.param_groups[1] == {**opt.param_groups[1], "params": resumed.param_groups[1]["params"]}


def test_adamw_lr_set_again_before_every_step_keeps_the_scale_a_schedule_started_with() -> None:
    # ZeroRedundancyOptimizer copies its constructor's options (adamw_lr among them) into the optimizer it wraps
    # before every step: read against the scheduled lr, AdamW's lr stayed pinned at adamw_lr as lr decayed.
    def trained(set_again: bool) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        params = [torch.randn(8, 6, generator=generator), torch.randn(6, generator=generator)]
        opt = Muon(params, lr=0.02, adamw_lr=0.01)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.1**epoch)
        for seed in range(4):
            if set_again:
                opt.param_groups[0]["adamw_lr"] = 0.01
            seeded_grads(params, seed)
            opt.step()
            schedule.step()
        assert opt.param_groups[0]["adamw_lr_scale"] == 0.5
        return params

    assert all(torch.equal(p, q) for p, q in zip(trained(set_again=True), trained(set_again=False)))


def test_a_refused_step_leaves_every_group_as_it_was() -> None:
    # The first group's timm key had been resolved in place before the second group was refused, and the refused
    # group had lost the value it kept, so that taking the bad key away did not undo the change.
    opt, params = two_groups_after_a_step({"adamw_lr_scale": 0.5})
    opt.param_groups[0]["betas"] = (0.8, 0.9)
    opt.param_groups[1]["fallback_lr_scale"] = -1.0
    groups_before = [dict(group) for group in opt.param_groups]
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match="adamw_lr_scale: -1.0"):
        opt.step()
    assert opt.param_groups == groups_before
    assert_unchanged(opt, params, before)
    del opt.param_groups[1]["fallback_lr_scale"]
    opt.step()
    assert opt.param_groups[1]["adamw_lr_scale"] == 0.5 and opt.param_groups[0]["adamw_betas"] == (0.8, 0.9)


@pytest.mark.parametrize("key, value", [("offload", "cpu"), ("process_group", None), ("qk_clip_threshold", 50.0),
                                        ("use_muon", True)])
def test_a_checkpoint_group_that_no_group_may_hold_is_refused_before_anything_loads(key: str, value: Any) -> None:
    # Loaded, it replaced the optimizer's state, and every step after was refused.
    source, _ = two_groups_after_a_step()
    saved = copy.deepcopy(source.state_dict())
    saved["param_groups"][1][key] = value  # the second group holds a vector: use_muon=True cannot train it
    opt, params = two_groups_after_a_step({"adamw_lr_scale": 0.5})
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=key):
        opt.load_state_dict(saved)
    assert_unchanged(opt, params, before)
    assert opt.param_groups[1]["adamw_lr_scale"] == 0.5
    opt.step()


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16, "int8"])
def test_a_checkpoint_with_state_in_another_memory_layout_resumes_exactly(state_dtype: str | None) -> None:
    # torch.save keeps a tensor's strides, and a load pre-hook may reshape state: transposed moments were loaded as
    # they were, and a step's compiled ops refused them part way through (the Muon parameters already updated).
    def model() -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        return [torch.randn(8, 256, generator=generator), torch.randn(256, 8, generator=generator),
                torch.randn(6, generator=generator)]

    def make(params: list[torch.Tensor]) -> "optimizer.Muon":
        return Muon([dict(params=params[:1]), dict(params=params[1:], use_muon=False)], lr=0.02,
                    state_dtype=state_dtype)

    params, expected_params = model(), model()
    source, expected = make(params), make(expected_params)
    for opt, trained in ((source, params), (expected, expected_params)):
        seeded_grads(trained, 0)
        opt.step()
    saved = copy.deepcopy(source.state_dict())
    for state in saved["state"].values():
        for key, value in state.items():
            if value.ndim == 2:
                state[key] = value.mT.contiguous().mT  # same values, column-major
    resumed = make(params)
    resumed.load_state_dict(saved)
    for seed in (1, 2):
        for opt, trained in ((resumed, params), (expected, expected_params)):
            seeded_grads(trained, seed)
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, expected_params))


def test_a_decay_beyond_float32s_range_steps_as_torch_rounds_it() -> None:
    # A fill with 1 - lr * weight_decay refused the number after the momentum had been written ("value cannot be
    # converted to type float without overflow"); torch.optim.Muon's arithmetic rounds it to an infinity and steps.
    settings = dict(lr=1e20, weight_decay=1e20, momentum=0.95, nesterov=True, ns_steps=5, eps=1e-7)
    param = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    reference = param.clone()
    ours = Muon([param], ns_coefficients="original", ns_dtype=torch.bfloat16, adjust_lr_fn="original", **settings)
    theirs = torch.optim.Muon([reference], adjust_lr_fn="original", **settings)
    seeded_grads([param, reference], 0)
    ours.step()
    theirs.step()
    assert torch.equal(param, reference) and torch.isinf(param).all()


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
def test_an_eps_beyond_float32s_range_scales_the_update_to_nothing(ns_dtype: torch.dtype) -> None:
    # The norm's clamp refused it after the momentum had been written (torch.optim.Muon's refuses it too, at the same
    # point); dividing by at least eps = 1e39 leaves nothing of the update, so the step only decays.
    param = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    expected = param.clone()
    opt = Muon([param], lr=0.02, weight_decay=0.1, eps=1e39, ns_dtype=ns_dtype)
    for seed in range(2):
        seeded_grads([param], seed)
        opt.step()
        expected.mul_(torch.tensor(1 - 0.02 * 0.1, dtype=torch.float32))
    assert torch.equal(param, expected)


def test_groups_added_after_a_load_or_a_copy_carry_only_muons_options() -> None:
    # torch's __setstate__ puts `differentiable` in the defaults, and add_param_group put it in every later group.
    opt = Muon([torch.randn(4, 4)])
    loaded = Muon([torch.randn(4, 4)])
    loaded.load_state_dict(opt.state_dict())
    for each in (loaded, copy.deepcopy(opt)):
        each.add_param_group(dict(params=[torch.randn(3, 3)]))
        assert each.param_groups[-1].keys() == opt.param_groups[0].keys()


def test_the_dict_given_becomes_the_group_as_in_torch() -> None:
    params = [torch.randn(8, 6), torch.randn(6)]
    given = dict(params=params[:1], betas=(0.8, 0.9))
    opt = Muon([given, dict(params=params[1:])], lr=0.02)
    assert opt.param_groups[0] is given and given["adamw_betas"] == (0.8, 0.9) and "betas" not in given
    added = dict(params=[torch.randn(3, 3)])
    opt.add_param_group(added)
    assert opt.param_groups[-1] is added


@pytest.mark.parametrize("options, message", [
    ({"adjust_lr_fn": np.array(["original", "spectral"])}, r"adjust_lr_fn"),
    ({"normalization": np.array([1, 2])}, r"Invalid normalization: array"),
    ({"lr": 10**400}, r"Invalid learning rate: 1000"),
    ({"ns_steps": 0}, r"^Invalid ns_steps: 0"),
    ({"lr": "0.1"}, r"^Invalid learning rate: '0.1' .*not a str"),
    ({"ns_coefficients": "cubic"}, r"^Invalid ns_coefficients: 'cubic' \(expected one of"),
    ({"ns_coefficients": [(3.0, -4.0)]}, r"^Invalid ns_coefficients\[0\]: \(3.0, -4.0\)"),
])
def test_an_unreadable_value_is_refused_naming_its_option(options: dict[str, Any], message: str) -> None:
    # numpy's "truth value of an array is ambiguous", an OverflowError, ns_steps named as ns_coefficients, a string lr
    # shown as a number, and ns_coefficients named as zeropower's `coefficients` inside its own option's message.
    with pytest.raises(ValueError, match=message):
        Muon([torch.randn(4, 4)], **options)


@pytest.mark.parametrize("sizes", [(1,), (1, 2), (2, 1)], ids=["fewer groups", "more groups", "other sizes"])
def test_a_state_dict_of_other_groups_is_refused_with_torchs_message(sizes: tuple[int, ...]) -> None:
    """Paired with these groups position by position, it was refused for a state shape that did not fit instead."""
    def built(group_sizes: tuple[int, ...]) -> Muon:
        params = [torch.randn(4 + i, 4) for i in range(sum(group_sizes))]
        groups = [params[sum(group_sizes[:g]):sum(group_sizes[:g + 1])] for g in range(len(group_sizes))]
        opt = Muon([dict(params=group) for group in groups])
        for param in params:
            param.grad = torch.ones_like(param)
        opt.step()
        return opt

    saved = built(sizes).state_dict()
    match = "different number of parameter groups" if len(sizes) != 2 else "doesn't match the size"
    with pytest.raises(ValueError, match=match):
        built((2, 1) if sizes == (1, 2) else (1, 2)).load_state_dict(saved)


def test_a_lazy_parameter_loads_no_state_and_is_refused_state_until_materialized() -> None:
    """torch.optim.AdamW loads an empty state into lazy parameters; reading the shape of one raised."""
    def lazy_optimizer() -> tuple[torch.nn.Module, Muon]:
        model = torch.nn.Sequential(torch.nn.LazyLinear(8))
        return model, Muon(model.parameters())

    _, opt = lazy_optimizer()
    lazy_optimizer()[1].load_state_dict(opt.state_dict())
    model, opt = lazy_optimizer()
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="parameter 0 has state, and the parameter it loads into is not materialized"):
        lazy_optimizer()[1].load_state_dict(opt.state_dict())


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_state_given_new_storage_between_steps_is_checked_as_new_state(change: str) -> None:
    """`.data` keeps a state tensor's identity: the held items went on with it unchecked, and a kernel refused a
    moment of another shape, or of another dtype, after earlier parameters had stepped. Now another shape is refused
    before any update, and another dtype converted as a loaded or copied state's is."""
    params = [torch.randn(8, 8), torch.randn(8), torch.randn(6, 8), torch.randn(8)]
    opt = Muon(params)
    seeded_grads(params, 0)
    opt.step()
    moment = opt.state[params[3]]["exp_avg"]
    moment.data = moment.data[:4].clone() if change == "shape" else moment.data.bfloat16()
    seeded_grads(params, 1)
    if change == "shape":
        before = [param.clone() for param in params]
        with pytest.raises(RuntimeError, match=r"Invalid state: 'exp_avg' of parameter #3 is \(4,\)"):
            opt.step()
        assert all(torch.equal(param, old) for param, old in zip(params, before))
    else:
        copied = copy.deepcopy(opt)
        opt.step()
        copied.step()
        assert all(torch.equal(param, theirs) for param, theirs in zip(params, copied.param_groups[0]["params"]))
