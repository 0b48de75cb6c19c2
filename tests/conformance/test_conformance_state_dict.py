"""Saving and restoring, on every routing: a state dict through torch.save/torch.load into a fresh optimizer, and
copy.deepcopy and pickle, continue training bit for bit; a malformed state dict is refused (ValueError, or what
torch's own optimizer does with it) and leaves parameters, state and groups as they were."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from conformance_support import (ROUTINGS, Muon, Routing, Settings, assert_all_equal, assert_same_state, clones,
                                 groups_snapshot, make_params, seeded_grads, state_snapshot)

ROUTING_IDS = [routing.name for routing in ROUTINGS]
EXTRA_SHAPES = [(8, 6), (6,)]  # a second group, with both routes, so group structure matters


def make_optimizer(routing: Routing, params: list[Tensor], extra: list[Tensor], named: bool = False) -> Muon:
    def listed(prefix: str, tensors: list[Tensor]) -> list[Any]:
        return [(f"{prefix}.{i}", t) for i, t in enumerate(tensors)] if named else list(tensors)

    groups = [dict(params=listed("routed", params), **routing.options), dict(params=listed("extra", extra))]
    return Muon(groups, **Settings().ours())


def train_steps(opt: Muon, params: list[Tensor], seeds: range) -> None:
    for seed in seeds:
        seeded_grads(params, seed)
        if seed == 1:  # one non-finite gradient: its skip counter is state that must survive too
            params[0].grad.view(-1)[:1] = float("nan")
        opt.step()


def through_a_file(state_dict: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer)  # torch's default, weights_only=True: what a user's resume script does


def assert_same_saved_state(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """The per-parameter state of two state dicts, tensor for tensor (group values: test_groups_survive_...)."""
    assert actual["state"].keys() == expected["state"].keys()
    for key, entry in expected["state"].items():
        assert actual["state"][key].keys() == entry.keys()
        for name, value in entry.items():
            assert torch.equal(actual["state"][key][name], value), (key, name)


@pytest.mark.parametrize("named", [False, True], ids=["positional", "named"])
@pytest.mark.parametrize("routing", ROUTINGS, ids=ROUTING_IDS)
def test_state_dict_round_trip_continues_bit_for_bit(routing: Routing, named: bool) -> None:
    total, saved_at = 5, 2
    params, extra = make_params(routing.shapes), make_params(EXTRA_SHAPES, seed=1)
    opt = make_optimizer(routing, params, extra, named)
    train_steps(opt, [*params, *extra], range(saved_at))
    opt.param_groups[1]["lr"] = 0.005  # a group value changed mid-run (as a scheduler would) is state as well
    checkpoint = through_a_file(opt.state_dict())
    fresh_params, fresh_extra = clones(params), clones(extra)
    train_steps(opt, [*params, *extra], range(saved_at, total))

    resumed = make_optimizer(routing, fresh_params, fresh_extra, named)
    resumed.load_state_dict(checkpoint)
    train_steps(resumed, [*fresh_params, *fresh_extra], range(saved_at, total))
    assert_all_equal([*fresh_params, *fresh_extra], [*params, *extra])
    assert_same_saved_state(resumed.state_dict(), opt.state_dict())
    assert opt.nonfinite_skips() == resumed.nonfinite_skips() == 1


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("routing", ROUTINGS, ids=ROUTING_IDS)
def test_copies_step_identically_and_independently(routing: Routing, how: str) -> None:
    params, extra = make_params(routing.shapes), make_params(EXTRA_SHAPES, seed=1)
    opt = make_optimizer(routing, params, extra)
    train_steps(opt, [*params, *extra], range(2))
    both = ([*params, *extra], opt)  # copied together, as a model and its optimizer are: the copy owns its tensors
    twin_params, twin = copy.deepcopy(both) if how == "deepcopy" else pickle.loads(pickle.dumps(both))
    original_params, original_state = clones([*params, *extra]), state_snapshot(opt)
    train_steps(twin, twin_params, range(2, 3))  # the copy first: the original must not notice
    assert_all_equal([*params, *extra], original_params)
    assert_same_state(state_snapshot(opt), original_state)
    train_steps(opt, [*params, *extra], range(2, 3))
    for seed in range(3, 5):
        train_steps(opt, [*params, *extra], range(seed, seed + 1))
        train_steps(twin, twin_params, range(seed, seed + 1))
    assert_all_equal(twin_params, [*params, *extra])
    assert_same_state(state_snapshot(twin), state_snapshot(opt))


def group_values(opt: Muon) -> list[dict[str, Any]]:
    return [{key: value for key, value in group.items() if key != "params"} for group in opt.param_groups]


def _restored(how: str, opt: Muon, params: list[Tensor]) -> Muon:
    if how == "load_state_dict":
        fresh = Muon([dict(params=clones(params))], **Settings().ours())
        fresh.load_state_dict(through_a_file(opt.state_dict()))
        return fresh
    return copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))


@pytest.mark.parametrize("how", ["load_state_dict", "deepcopy", "pickle"])
def test_groups_survive_a_round_trip_unchanged(how: str) -> None:
    params = make_params([(8, 6), (6,)])
    opt = Muon([dict(params=params)], **Settings().ours())
    train_steps(opt, params, range(2))
    assert group_values(_restored(how, opt, params)) == group_values(opt)


# --- malformed state dicts ---------------------------------------------------------------------------------------

def wrong_shape(value: Tensor) -> Tensor:
    return torch.zeros(*value.shape[:-1], value.shape[-1] + 1) if value.ndim else torch.zeros(1)


def first_with(state: dict[int, dict[str, Any]], key: str) -> int:
    return min(index for index, entry in state.items() if key in entry)


def per_parameter(key: str, action: str) -> Callable[[dict[str, Any]], None]:
    """Spoil `key` of the first parameter that has it: drop it, or give it the wrong shape."""
    def spoil(state_dict: dict[str, Any]) -> None:
        entry = state_dict["state"][first_with(state_dict["state"], key)]
        if action == "missing":
            del entry[key]
        else:
            entry[key] = wrong_shape(entry[key])
    return spoil


def outcome(opt: torch.optim.Optimizer, params: list[Tensor], state_dict: dict[str, Any]) -> tuple[str, type] | None:
    """Where loading this state dict fails ("load", or "step" on the next step) and with what; None if neither.

    On our optimizer it also checks that the failure changed nothing: at load, parameters, state and groups; at
    the step after a load that passed, parameters and state."""
    is_ours = isinstance(opt, Muon)
    before = clones(params), state_snapshot(opt), groups_snapshot(opt)
    try:
        opt.load_state_dict(state_dict)
    except Exception as error:  # noqa: BLE001 - the type is what we compare
        if is_ours:
            assert_all_equal(params, before[0])
            assert_same_state(state_snapshot(opt), before[1])
            assert groups_snapshot(opt) == before[2]
        return "load", type(error)
    loaded = clones(params), state_snapshot(opt)
    seeded_grads(params, 9)
    try:
        opt.step()
    except Exception as error:  # noqa: BLE001
        if is_ours:
            assert_all_equal(params, loaded[0])
            assert_same_state(state_snapshot(opt), loaded[1])
        return "step", type(error)
    return None


def trained(factory: Callable[[list[Tensor]], torch.optim.Optimizer],
            shapes: list[tuple[int, ...]]) -> tuple[list[Tensor], torch.optim.Optimizer]:
    params = make_params(shapes, seed=3)
    opt = factory(params)
    for seed in range(2):
        seeded_grads(params, seed)
        opt.step()
    return params, opt


def torch_truth(key: str, spoil: Callable[[dict[str, Any]], None]) -> tuple[str, type] | None:
    """What torch's own optimizer for that state does with the same spoiling: torch.optim.Muon keeps
    momentum_buffer, torch.optim.AdamW the rest."""
    if key == "momentum_buffer":
        factory, shapes = (lambda ps: torch.optim.Muon(ps, **Settings().torch_muon())), [(8, 6)]
    else:
        factory, shapes = (lambda ps: torch.optim.AdamW(ps, **Settings().torch_adamw())), [(6,)]
    _, source = trained(factory, shapes)
    state_dict = copy.deepcopy(source.state_dict())
    spoil(state_dict)
    target_params, target = trained(factory, shapes)
    return outcome(target, target_params, state_dict)


def state_key_cases() -> list[Any]:
    cases = []
    for routing in ROUTINGS:
        keys = (["momentum_buffer"] if routing.has_muon else []) + (
            ["exp_avg", "exp_avg_sq", "step"] if routing.has_adamw else [])
        for key in keys:
            for action in ("wrong_shape", "missing"):
                cases.append(pytest.param(routing, key, action, id=f"{routing.name}-{key}-{action}"))
    return cases


@pytest.mark.parametrize("routing, key, action", state_key_cases())
def test_spoiled_parameter_state_is_refused_and_changes_nothing(routing: Routing, key: str, action: str) -> None:
    spoil = per_parameter(key, action)
    count = len(routing.shapes)

    def factory(params: list[Tensor]) -> Muon:
        return make_optimizer(routing, params[:count], params[count:])

    _, source = trained(factory, [*routing.shapes, *EXTRA_SHAPES])
    state_dict = copy.deepcopy(source.state_dict())
    spoil(state_dict)
    target_params, target = trained(factory, [*routing.shapes, *EXTRA_SHAPES])
    ours = outcome(target, target_params, state_dict)
    # Wrong shapes: README promises a ValueError before anything is loaded (torch would accept them and its fused
    # kernels would run outside the tensors). Missing entries: a ValueError at load, or what torch's own does.
    allowed = {("load", ValueError)} if action == "wrong_shape" else {("load", ValueError), torch_truth(key, spoil)}
    assert ours in allowed


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda state_dict: state_dict.pop(key)


def _group_without_params(state_dict: dict[str, Any]) -> None:
    del state_dict["param_groups"][0]["params"]


def _one_group_fewer(state_dict: dict[str, Any]) -> None:
    state_dict["param_groups"].pop()


def _one_group_more(state_dict: dict[str, Any]) -> None:
    state_dict["param_groups"].append({**state_dict["param_groups"][-1], "params": [98, 99]})


def _one_parameter_fewer(state_dict: dict[str, Any]) -> None:
    state_dict["param_groups"][0]["params"].pop()


def _one_parameter_more(state_dict: dict[str, Any]) -> None:
    state_dict["param_groups"][0]["params"].append(99)


def _state_for_no_parameter(state_dict: dict[str, Any]) -> None:
    state_dict["state"][99] = {"exp_avg": torch.zeros(3)}


def _unknown_top_level_key(state_dict: dict[str, Any]) -> None:
    state_dict["schema"] = 2


STRUCTURE_CASES = {"no_state": _drop("state"), "no_param_groups": _drop("param_groups"),
                   "group_without_params": _group_without_params, "one_group_fewer": _one_group_fewer,
                   "one_group_more": _one_group_more, "one_parameter_fewer": _one_parameter_fewer,
                   "one_parameter_more": _one_parameter_more, "state_for_no_parameter": _state_for_no_parameter,
                   "unknown_top_level_key": _unknown_top_level_key}


@pytest.mark.parametrize("case", STRUCTURE_CASES)
def test_malformed_state_dict_is_treated_as_adamw_treats_it_and_changes_nothing(case: str) -> None:
    # Two groups of a matrix and a vector each, for ours and for torch.optim.AdamW (which routes nothing).
    shapes = [(8, 6), (6,), (6, 8), (4,)]

    def ours(ps: list[Tensor]) -> Muon:
        return Muon([dict(params=ps[:2]), dict(params=ps[2:])], **Settings().ours())

    def adamw(ps: list[Tensor]) -> torch.optim.Optimizer:
        return torch.optim.AdamW([dict(params=ps[:2]), dict(params=ps[2:])], **Settings().torch_adamw())

    results = []
    for factory in (adamw, ours):
        _, source = trained(factory, shapes)
        state_dict = copy.deepcopy(source.state_dict())
        STRUCTURE_CASES[case](state_dict)
        target_params, target = trained(factory, shapes)
        results.append(outcome(target, target_params, state_dict))
    theirs, mine = results
    assert mine in {("load", ValueError), theirs}


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16, "int8"])
def test_dcps_full_state_dict_round_trip_continues_bit_for_bit(state_dtype: torch.dtype | str | None) -> None:
    # StateDictOptions(full_state_dict=True), as Accelerate saves an FSDP2 model's optimizer: torch's gathering takes
    # tensors, numbers, strings, lists, dicts and None, and refused the dtypes Muon's groups hold
    # ("Unexpected value type <class 'torch.dtype'>"); a state dict names them.
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 300), torch.nn.Linear(300, 4))

    options = StateDictOptions(full_state_dict=True)
    net, twin = model(), model()
    opt = Muon(net.parameters(), lr=0.02, ns_dtype=torch.float32, state_dtype=state_dtype)
    params, twin_params = list(net.parameters()), list(twin.parameters())
    train_steps(opt, params, range(2))
    saved = through_a_file(get_optimizer_state_dict(net, opt, options=options))
    assert saved["param_groups"][0]["ns_dtype"] == "torch.float32"
    with torch.no_grad():
        for twin_param, param in zip(twin_params, params):
            twin_param.copy_(param)
    resumed = Muon(twin.parameters(), lr=0.02, state_dtype=state_dtype)  # DCP loads into the state at hand
    set_optimizer_state_dict(twin, resumed, saved, options=options)
    for key in ("ns_dtype", "comm_dtype", "state_dtype"):  # (torch's gathering makes adamw_betas a list, as AdamW's)
        assert resumed.param_groups[0][key] == opt.param_groups[0][key], key
    train_steps(opt, params, range(2, 4))
    train_steps(resumed, twin_params, range(2, 4))
    assert_all_equal(twin_params, params)
    assert_same_state(state_snapshot(resumed), state_snapshot(opt))
