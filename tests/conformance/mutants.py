"""Deliberately broken products, one or more per kind of property: a test that cannot fail proves nothing.

`CONFORMANCE_MUTANT=<name> pytest tests/conformance` runs the battery against one of them (conftest.py applies it
for the session); `python tests/conformance/mutants.py [name ...]` runs each mutant against the tests meant to catch
it and prints whether they did. A mutant is caught when at least one selected test fails. The breakages patch
private names of the product (muon.py, the modules it imports, functional.py), so they follow its internals: a mutant
whose target has moved fails loudly when applied (AttributeError); one whose target stays but no longer takes part in
the step (routing once asked `Muon._uses_muon`, then a module function) is caught only by running it, which the suite
does (test_conformance_mutants.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Mutant:
    breaks: str  # what is wrong with the product
    selects: str  # pytest -k expression: the tests that must catch it
    apply: Callable[[type, Any, Any], None]  # (Muon, its module, the functional module)


def _replace(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    setattr(owner, name, make(getattr(owner, name)))  # getattr first: a missing target is an AttributeError


def _skip_step(method: str) -> Callable[[type, Any, Any], None]:
    return lambda muon, module, functional: _replace(muon, method, lambda real: lambda self, group, items, *rest: None)


def _group_value(method: str, key: str, value: Callable[[Any, dict], Any]) -> Callable[[type, Any, Any], None]:
    """The step method reads `key` from somewhere other than the group it is given."""
    def apply(muon: type, module: Any, functional: Any) -> None:
        _replace(muon, method, lambda real: lambda self, group, items, *rest: real(
            self, {**group, key: value(self, group)}, items, *rest))
    return apply


def _skip_last_group(muon: type, module: Any, functional: Any) -> None:
    for method in ("_muon_step", "_adamw_step"):
        _replace(muon, method, lambda real: lambda self, group, items, *rest: None if (
            len(self.param_groups) > 1 and group is self.param_groups[-1]) else real(self, group, items, *rest))


# What a step hands its parameters to: the single-device updates, through their offload staging.
_UPDATES = ("staged_muon_update", "staged_adamw_update")


def _items_filtered(keep: Callable[[Any], bool]) -> Callable[[type, Any, Any], None]:
    """The updates see only the items `keep` accepts (lists and flag tensors beside them are filtered alike)."""
    def wrap(real: Callable) -> Callable:
        def filtered(items: list, *args: Any, **kwargs: Any) -> Any:
            kept = [i for i, item in enumerate(items) if keep(item)]

            def beside(arg: Any) -> Any:  # a tensor or list of one entry per item (flags, per-item lrs): filtered too
                if isinstance(arg, torch.Tensor) and len(arg) == len(items):
                    return arg[kept]
                if isinstance(arg, list | tuple) and len(arg) == len(items):
                    return [arg[i] for i in kept]
                return arg
            return real([items[i] for i in kept], *map(beside, args), **{key: beside(value)
                                                                       for key, value in kwargs.items()})
        return filtered

    def apply(muon: type, module: Any, functional: Any) -> None:
        for name in _UPDATES:
            _replace(module, name, wrap)
    return apply


def _updates_a_contiguous_copy(muon: type, module: Any, functional: Any) -> None:
    def wrap(real: Callable) -> Callable:
        return lambda items, *args, **kwargs: real(
            [dataclasses.replace(item, param=item.param.contiguous()) for item in items], *args, **kwargs)
    for name in _UPDATES:
        _replace(module, name, wrap)


def _route_every_matrix_to_muon(muon: type, module: Any, functional: Any) -> None:
    _replace(module, "_view", lambda real: lambda group, param: real(
        {**group, "use_muon": True} if group["use_muon"] is None and param.ndim >= 2 and param.numel() else group,
        param))


def _empty_parameter_stalls_its_group(muon: type, module: Any, functional: Any) -> None:
    for method in ("_muon_step", "_adamw_step"):
        _replace(muon, method, lambda real: lambda self, group, items, *rest: None if any(
            p.numel() == 0 for p in group["params"]) else real(self, group, items, *rest))


def _forced_empty_accepted(muon: type, module: Any, functional: Any) -> None:
    _replace(module, "check_forced_muon", lambda real: lambda name, shape: None if 0 in shape else real(name, shape))


def _closure_without_autograd(muon: type, module: Any, functional: Any) -> None:
    import torch

    def wrap(real: Callable) -> Callable:
        def step(self: Any, closure: Callable | None = None, **kwargs: Any) -> Any:
            return real(self, None if closure is None else (lambda: torch.no_grad()(closure)()), **kwargs)
        return step
    _replace(muon, "step", wrap)


def _closure_loss_dropped(muon: type, module: Any, functional: Any) -> None:
    _replace(muon, "step", lambda real: lambda self, *args, **kwargs: real(self, *args, **kwargs) and None)


def _zero_grad_does_nothing(muon: type, module: Any, functional: Any) -> None:
    muon.zero_grad = lambda self, set_to_none=True: None


def _add_param_group_resets_state(muon: type, module: Any, functional: Any) -> None:
    def wrap(real: Callable) -> Callable:
        def add_param_group(self: Any, group: dict) -> None:
            real(self, group)
            self.state.clear()
        return add_param_group
    _replace(muon, "add_param_group", wrap)


def _adamw_lr_from_the_schedule_start(muon: type, module: Any, functional: Any) -> None:
    # The defect this battery was asked to expect: AdamW's lr follows the schedulers that record `initial_lr` and
    # stays at the constructor's lr * scale under anything else (ReduceLROnPlateau, a hand-set group["lr"]).
    def adamw_lr(self: Any, group: dict) -> float:
        lr = float(group["lr"]) if "initial_lr" in group else float(self.defaults["lr"])
        return lr * float(group["adamw_lr_scale"])
    _replace(muon, "_adamw_lr", lambda real: adamw_lr)


def _state_dict_without_momentum(muon: type, module: Any, functional: Any) -> None:
    def wrap(real: Callable) -> Callable:
        def state_dict(self: Any) -> dict:
            saved = real(self)
            return {**saved, "state": {k: {n: v for n, v in e.items() if n != "momentum_buffer"}
                                       for k, e in saved["state"].items()}}
        return state_dict
    _replace(muon, "state_dict", wrap)


def _no_shape_check(muon: type, module: Any, functional: Any) -> None:
    _replace(module, "check_saved_state", lambda real: lambda state_dict, groups: None)


def _load_changes_then_refuses(muon: type, module: Any, functional: Any) -> None:
    def wrap(real: Callable) -> Callable:
        def load_state_dict(self: Any, state_dict: dict) -> None:
            self.param_groups[0]["lr"] = 0.123
            real(self, state_dict)
        return load_state_dict
    _replace(muon, "load_state_dict", wrap)


def _copies_lose_state(muon: type, module: Any, functional: Any) -> None:
    _replace(muon, "__getstate__", lambda real: lambda self: {**real(self), "state": {}})


def _step_hooks_bypassed(muon: type, module: Any, functional: Any) -> None:
    def wrap(real: Callable) -> Callable:
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            return real(self, *args, **kwargs)
        step.hooked = True  # torch then leaves it unwrapped: no step hook ever runs
        return step
    _replace(muon, "step", wrap)


def _state_dict_hooks_twice(muon: type, module: Any, functional: Any) -> None:
    _replace(muon, "state_dict", lambda real: lambda self: real(self) and real(self))


def _shared_parameters_dropped(muon: type, module: Any, functional: Any) -> None:
    def wrap(real: Callable) -> Callable:
        def add_param_group(self: Any, group: dict) -> None:
            taken = {id(p) for g in self.param_groups for p in g["params"]}
            params = group["params"]
            params = [params] if not isinstance(params, list | tuple) else params
            real(self, {**group, "params": [p for p in params if id(p) not in taken]})
        return add_param_group
    _replace(muon, "add_param_group", wrap)


def _default_lr_changed(muon: type, module: Any, functional: Any) -> None:
    defaults = list(muon.__init__.__defaults__)
    defaults[0] = 2e-3  # lr comes first
    muon.__init__.__defaults__ = tuple(defaults)


def _lr_scale_off_by_3_percent(muon: type, module: Any, functional: Any) -> None:
    _replace(functional, "adjusted_lr", lambda real: lambda *args: real(*args) * 1.03)


def _non_2d_refused(muon: type, module: Any, functional: Any) -> None:
    def wrap(real: Callable) -> Callable:
        def add_param_group(self: Any, group: dict) -> None:
            if any(getattr(p, "ndim", 2) != 2 for p in group["params"]):
                raise ValueError("only 2D parameters")
            real(self, group)
        return add_param_group
    _replace(muon, "add_param_group", wrap)


def _lr_from_defaults(muon: type, module: Any, functional: Any) -> None:
    for method in ("_muon_step", "_adamw_step"):
        _group_value(method, "lr", lambda self, group: self.defaults["lr"])(muon, module, functional)


def _kept_options_go_stale(muon: type, module: Any, functional: Any) -> None:
    _replace(module.KeptOptions, "holds", lambda real: lambda self, options: True)


def _own_wording_only(muon: type, module: Any, functional: Any) -> None:
    _replace(sys.modules[f"{module.__package__}.group_options"], "_TORCH_WORDING", lambda real: {})


MUTANTS: dict[str, Mutant] = {
    "adamw_skipped": Mutant("AdamW-routed parameters never update", "test_step_equals_torch",
                            _skip_step("_adamw_step")),
    "muon_skipped": Mutant("Muon-routed parameters never update", "test_step_equals_torch", _skip_step("_muon_step")),
    "no_weight_decay": Mutant("Muon ignores weight_decay", "test_step_equals_torch and defaults",
                              _group_value("_muon_step", "weight_decay", lambda self, group: 0.0)),
    "no_nesterov": Mutant("Muon ignores nesterov=True", "test_step_equals_torch and defaults",
                          _group_value("_muon_step", "nesterov", lambda self, group: False)),
    "no_momentum": Mutant("Muon ignores momentum", "test_step_equals_torch and defaults",
                          _group_value("_muon_step", "momentum", lambda self, group: 0.0)),
    "float32_only": Mutant("parameters of other dtypes are not updated", "every_float_dtype",
                           _items_filtered(lambda item: str(item.param.dtype) == "torch.float32")),
    "strided_copy_updated": Mutant("a strided parameter's update goes to a copy", "strided",
                                   _updates_a_contiguous_copy),
    "degenerate_to_muon": Mutant("1x1 matrices are routed to Muon", "one_by_one",
                                 _route_every_matrix_to_muon),
    "empty_parameter_stalls_group": Mutant("a group holding an empty parameter does not step", "zero_size",
                                           _empty_parameter_stalls_its_group),
    "forced_empty_accepted": Mutant("use_muon=True accepts an empty parameter", "zero_size",
                                    _forced_empty_accepted),
    "closure_without_autograd": Mutant("the closure runs under no_grad", "closure", _closure_without_autograd),
    "closure_loss_dropped": Mutant("step returns None instead of the closure's loss", "closure",
                                   _closure_loss_dropped),
    "zero_grad_noop": Mutant("zero_grad does nothing", "zero_grad", _zero_grad_does_nothing),
    "add_param_group_resets_state": Mutant("add_param_group drops the existing state", "add_param_group",
                                           _add_param_group_resets_state),
    "last_group_skipped": Mutant("step skips the last of several groups", "add_param_group", _skip_last_group),
    "lr_from_defaults": Mutant("the step reads lr from the defaults, not the group",
                               "scheduled_values or adamw_lr_moves", _lr_from_defaults),
    "momentum_from_defaults": Mutant("Muon reads momentum from the defaults, not the group",
                                     "scheduled_values and (OneCycleLR or CyclicLR)",
                                     _group_value("_muon_step", "momentum", lambda self, g: self.defaults["momentum"])),
    "adamw_lr_from_schedule_start": Mutant("AdamW's lr ignores ReduceLROnPlateau and hand-set lr",
                                           "adamw_lr_moves", _adamw_lr_from_the_schedule_start),
    "state_dict_without_momentum": Mutant("state_dict leaves out momentum buffers", "round_trip",
                                          _state_dict_without_momentum),
    "no_shape_check": Mutant("state of the wrong shape is loaded", "spoiled", _no_shape_check),
    "load_changes_then_refuses": Mutant("a refused load has already changed a group",
                                        "malformed or spoiled", _load_changes_then_refuses),
    "copies_lose_state": Mutant("deepcopy and pickle drop the state", "copies", _copies_lose_state),
    "step_hooks_bypassed": Mutant("step hooks never run", "hooks", _step_hooks_bypassed),
    "state_dict_hooks_twice": Mutant("state_dict runs its hooks twice", "hook", _state_dict_hooks_twice),
    "shared_parameters_dropped": Mutant("a parameter already in a group is silently dropped, not refused",
                                        "refused_as_adamw", _shared_parameters_dropped),
    "default_lr_changed": Mutant("the default lr moved to 2e-3", "pinned", _default_lr_changed),
    "lr_scale_off_3_percent": Mutant("Muon's per-matrix lr scale is 3% too large",
                                     "torch_muon or test_step_equals_torch", _lr_scale_off_by_3_percent),
    "non_2d_refused": Mutant("non-2D parameters are refused as torch.optim.Muon does", "non_2d", _non_2d_refused),
    "kept_options_go_stale": Mutant("a step keeps what it derived from a group's options after they change",
                                    "scheduled_values", _kept_options_go_stale),
    "own_wording_only": Mutant("error messages leave out torch.optim's wording", "torchs_error_case",
                               _own_wording_only),
}


def apply(name: str) -> None:
    """Break the loaded product in the way `name` says (for this process only)."""
    from conformance_support import Muon, muon_module

    functional = sys.modules[f"{Muon.__module__.rsplit('.', 1)[0]}.functional"]
    MUTANTS[name].apply(Muon, muon_module, functional)


def run(names: list[str], workers: int = 1) -> int:
    """Each mutant against its tests, in a fresh pytest process, `workers` processes at a time; prints each outcome in
    `names`' order and returns how many were not caught."""
    with ThreadPoolExecutor(workers) as pool:
        outcomes = list(pool.map(_outcome, names))
    for _, line in outcomes:
        print(line)
    return sum(not caught for caught, _ in outcomes)


def _outcome(name: str) -> tuple[bool, str]:
    """Whether the mutant's tests caught it (at least one failed), and a line saying so."""
    mutant = MUTANTS[name]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE), "-k",
                             mutant.selects], env={**os.environ, "CONFORMANCE_MUTANT": name},
                            capture_output=True, text=True, cwd=HERE.parents[1])
    # A mutant whose target has moved stops pytest before any test runs, saying why on stderr.
    summary = (result.stdout.strip().splitlines() or result.stderr.strip().splitlines() or ["(no output)"])[-1]
    failed = re.search(r"(\d+) failed", summary)
    caught = failed is not None and int(failed.group(1)) > 0
    return caught, f"{'caught' if caught else 'MISSED'}  {name:30} {mutant.breaks}  [-k '{mutant.selects}']: {summary}"


if __name__ == "__main__":
    sys.exit(1 if run(sys.argv[1:] or list(MUTANTS), workers=os.cpu_count() or 1) else 0)
