"""Optimizer hooks: the same hooks on ours and on torch.optim.AdamW, driven through the same calls, must fire in the
same order with the same arguments, and what a hook returns must be used as torch uses it."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from conformance_support import Muon, Settings, assert_all_equal, clones, make_params, seeded_grads

SHAPES = [(8, 6), (6,), (6, 8), ()]


def two_groups(factory: Callable[..., torch.optim.Optimizer], params: list[Tensor],
               names: tuple[str, ...] | None = None) -> torch.optim.Optimizer:
    listed: list[Any] = list(zip(names, params)) if names else list(params)
    return factory([dict(params=listed[:2]), dict(params=listed[2:], lr=0.005)])


def ours(groups: list[dict[str, Any]]) -> Muon:
    return Muon(groups, **Settings().ours())


def adamw(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, **Settings().torch_adamw())


class Recorder:
    """Every hook torch.optim offers, registered on one optimizer (and the global step hooks), writing what it was
    called with into `events` in a form comparable across optimizer classes."""

    def __init__(self, opt: torch.optim.Optimizer, closure: Callable[[], Any]) -> None:
        self.opt, self.closure, self.events = opt, closure, []
        self.handles: list[RemovableHandle] = []
        register: list[tuple[Callable[..., RemovableHandle], str, dict[str, Any]]] = [
            (register_optimizer_step_pre_hook, "global_step_pre", {}),
            (register_optimizer_step_post_hook, "global_step_post", {}),
            (opt.register_step_pre_hook, "step_pre_1", {}), (opt.register_step_pre_hook, "step_pre_2", {}),
            (opt.register_step_post_hook, "step_post_1", {}), (opt.register_step_post_hook, "step_post_2", {}),
            (opt.register_state_dict_pre_hook, "state_dict_pre", {}),
            (opt.register_state_dict_pre_hook, "state_dict_pre_prepended", {"prepend": True}),
            (opt.register_state_dict_post_hook, "state_dict_post", {}),
            (opt.register_load_state_dict_pre_hook, "load_pre", {}),
            (opt.register_load_state_dict_post_hook, "load_post", {}),
            (opt.register_load_state_dict_post_hook, "load_post_prepended", {"prepend": True}),
        ]
        for method, name, options in register:
            self.handles.append(method(self._hook(name), **options))

    def _describe(self, value: Any) -> Any:
        if value is self.opt:
            return "<optimizer>"
        if value is self.closure:
            return "<closure>"
        if isinstance(value, tuple):
            return tuple(self._describe(v) for v in value)
        if isinstance(value, dict) and set(value) >= {"state", "param_groups"}:
            return ("<state_dict>", sorted(value), [len(g["params"]) for g in value["param_groups"]],
                    [g["lr"] for g in value["param_groups"]], len(value["state"]))
        if isinstance(value, dict):
            return {key: self._describe(v) for key, v in value.items()}
        return repr(value)

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(optimizer: torch.optim.Optimizer, *args: Any) -> None:
            if optimizer is self.opt or not name.startswith("global"):  # global hooks see every optimizer
                self.events.append((name, self._describe(optimizer), self._describe(args)))
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def drive(factory: Callable[..., torch.optim.Optimizer]) -> list[tuple[Any, ...]]:
    """Steps with and without a closure (positional and keyword), a state dict saved and loaded; then the hooks are
    removed and the same calls must record nothing more."""
    params = [p.requires_grad_() for p in make_params(SHAPES)]
    opt = two_groups(factory, params)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = sum((p ** 2).sum() for p in params)
        loss.backward()
        return loss

    recorder = Recorder(opt, closure)

    def calls() -> None:
        seeded_grads(params, 0)
        opt.step()
        opt.step(closure)
        opt.step(closure=closure)
        opt.load_state_dict(opt.state_dict())

    calls()
    count = len(recorder.events)
    recorder.remove()
    calls()
    assert len(recorder.events) == count, "a removed hook fired"
    return recorder.events


def test_every_hook_fires_in_order_with_torchs_arguments() -> None:
    theirs, mine = drive(adamw), drive(ours)
    assert len(theirs) == 3 * 6 + 3 + 3  # 3 steps x 6 step hooks; 3 around state_dict(); 3 around loading
    assert mine == theirs


def _replace_closure(replacement: Callable[[], float]) -> Callable[..., tuple[tuple, dict]]:
    # torch passes step's own arguments, the optimizer first, and calls step with what the hook returns.
    return lambda opt, args, kwargs: (args[:1], {"closure": replacement})


@pytest.mark.parametrize("factory", [adamw, ours], ids=["AdamW", "Muon"])
def test_what_hooks_return_is_used(factory: Callable[..., torch.optim.Optimizer]) -> None:
    # AdamW runs the same test: it shows what torch does, so that ours is held to torch's behaviour, not a guess.
    params = make_params(SHAPES)
    opt = two_groups(factory, params)
    seeded_grads(params, 0)
    opt.register_step_pre_hook(_replace_closure(lambda: 7.0))  # a pre hook may replace step's arguments
    assert opt.step() == 7.0
    opt.register_state_dict_post_hook(lambda o, state_dict: {**state_dict, "note": "saved"})
    saved = opt.state_dict()
    assert saved["note"] == "saved"

    def halve_lr(o: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        groups = [{**g, "lr": g["lr"] / 2} for g in state_dict["param_groups"]]
        return {**state_dict, "param_groups": groups}

    opt.register_load_state_dict_pre_hook(halve_lr)  # a pre hook's result is what gets loaded
    opt.load_state_dict(saved)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.0025]


def _rename(state_dict: dict[str, Any]) -> dict[str, Any]:
    groups = [{**g, "param_names": [n.replace("old.", "new.") for n in g["param_names"]]}
              for g in state_dict["param_groups"]]
    return {**state_dict, "param_groups": groups}


def _unflatten(state_dict: dict[str, Any]) -> dict[str, Any]:
    state = {key: {**entry, "momentum_buffer": entry["momentum_buffer"].view(8, 6)} if key == 0 else entry
             for key, entry in state_dict["state"].items()}
    return {**state_dict, "state": state}


def _flatten(state_dict: dict[str, Any]) -> None:
    state_dict["state"][0]["momentum_buffer"] = state_dict["state"][0]["momentum_buffer"].flatten()


@pytest.mark.parametrize("case", ["renamed_parameters", "flattened_momentum"])
def test_a_load_pre_hook_adapts_a_checkpoint_before_anything_checks_it(case: str) -> None:
    # torch documents the load_state_dict pre hook as the way to adapt a checkpoint whose parameters differ (e.g.
    # renamed), and runs it first thing; a checkpoint the hook repairs must then resume exactly.
    params = make_params(SHAPES)
    opt = two_groups(ours, params, ("old.w", "old.b", "old.v", "old.s"))
    seeded_grads(params, 0)
    opt.step()
    checkpoint = copy.deepcopy(opt.state_dict())
    resumed_params = clones(params)
    if case == "renamed_parameters":
        resumed = two_groups(ours, resumed_params, ("new.w", "new.b", "new.v", "new.s"))
        resumed.register_load_state_dict_pre_hook(lambda o, state_dict: _rename(state_dict))
    else:
        resumed = two_groups(ours, resumed_params)
        _flatten(checkpoint)
        resumed.register_load_state_dict_pre_hook(lambda o, state_dict: _unflatten(state_dict))
    resumed.load_state_dict(checkpoint)
    for opt_, params_ in ((opt, params), (resumed, resumed_params)):
        seeded_grads(params_, 1)
        opt_.step()
    assert_all_equal(resumed_params, params)
