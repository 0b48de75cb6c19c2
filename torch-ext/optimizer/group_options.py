"""A param group's options: entered in the form groups keep (timm's spellings, `adamw_lr` as a scale, the Nones
that stand for values), entered again when a training loop sets such a key between steps, and validated in torch's
words."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .coefficients import resolve_coefficients
from .functional import ADJUST_LR_FNS
from .newton_schulz import NS_ALGORITHMS, PRECONDITIONERS, check_safety_factor
from .normalization import NORMALIZATIONS
from .option_values import (as_real, check_bool, check_choice, check_chunk_size, check_float_dtype, check_ns_steps,
                            is_one_of, is_real_scalar)
from .routing import CONV_MODES, PARAM_LAYOUTS
from .state_precision import STATE_DTYPES


def learning_rate(value: Any) -> float | Tensor:
    """lr as the update math takes it: a tensor lr stays a tensor, so that a compiled step never reads its value
    (which would break the graph, and recompile whenever a schedule moves it)."""
    return value.reshape(()) if isinstance(value, Tensor) else float(value)


# torch.optim's wording for the options it shares with us, which is what users search for.
_TORCH_WORDING = {"lr": "learning rate", "eps": "epsilon value", "weight_decay": "weight_decay value",
                  "momentum": "momentum value"}


def _invalid(name: str, value: Any, expected: str) -> ValueError:
    """`Invalid learning rate: -1 (lr: expected ...)`: torch's words where torch has the option, then ours."""
    if name in _TORCH_WORDING:
        shown = repr(value) if isinstance(value, str) else value  # '0.1', the string, is not 0.1
        return ValueError(f"Invalid {_TORCH_WORDING[name]}: {shown} ({name}: expected {expected})")
    return ValueError(f"Invalid {name}: {value!r} (expected {expected})")


def _check_nonnegative(name: str, value: Any, read_tensors: bool = True) -> None:
    if isinstance(value, Tensor):
        if not is_real_scalar(value):
            raise ValueError(f"Tensor {name} must be 1-element (got a {value.dtype} tensor of shape "
                             f"{tuple(value.shape)})")
        if not read_tensors or torch.compiler.is_compiling():
            return  # reading it would sync or break the graph; torch optimizers do not check tensor values at step
    number = as_real(value)
    if number is None:  # a 0-dim numpy array prints as its number: say why it is none
        raise _invalid(name, value, f"a finite number >= 0, not a {type(value).__name__}")
    if not 0 <= number < math.inf:  # comparisons, which dynamo traces on a float lr it made dynamic (not isfinite)
        raise _invalid(name, value, "a finite number >= 0")


def _check_fraction(name: str, value: Any) -> None:
    _check_nonnegative(name, value)
    if as_real(value) >= 1:
        raise _invalid(name, value, "a number in [0, 1)")


# timm's Muon names some of our options differently; a timm config runs unchanged because its keys are converted to
# ours where groups enter (construction, add_param_group, load_state_dict): one code path per behaviour.
_TIMM_KEYS = {"fallback_lr_scale": "adamw_lr_scale", "betas": "adamw_betas"}
_TIMM_VALUES = {("adjust_lr_fn", "rms_to_rms"): "spectral"}
_TIMM_ALGOS = {"muon": None, "adamuon": "element"}  # timm's `algo`: AdaMuon is our per-element normalization


def _from_timm_spellings(group: dict[str, Any]) -> dict[str, Any]:
    """The group with timm's keys and values in our spelling (`use_fallback=True` is `use_muon=False`, `False` is
    `use_muon=None`)."""
    group = dict(group)
    for timm_key, ours in _TIMM_KEYS.items():
        if group.get(timm_key) is None:
            group.pop(timm_key, None)
            continue
        _refuse_both_names(timm_key, group[timm_key], ours, group)
        group[ours] = group.pop(timm_key)
    if "use_fallback" in group:
        use_fallback = group.pop("use_fallback")
        if use_fallback is not None:
            check_bool("use_fallback", use_fallback)
            _refuse_both_names("use_fallback", use_fallback, "use_muon", group)
            group["use_muon"] = False if use_fallback else None  # timm's False routes by shape, as no key does
    algo = group.pop("algo", None)
    if algo is not None:
        check_choice("algo", algo, _TIMM_ALGOS)
        _refuse_both_names("algo", algo, "normalization", group)
        group["normalization"] = _TIMM_ALGOS[algo]
    for (key, timm_value), ours in _TIMM_VALUES.items():
        if is_one_of(group.get(key), (timm_value,)):
            group[key] = ours
    return group


def _refuse_both_names(timm_key: str, value: Any, ours: str, group: dict[str, Any]) -> None:
    """timm's name and ours for one option, both given (even with equal values): which one is meant is unclear."""
    if group.get(ours) is not None:
        raise ValueError(f"Invalid {timm_key}: {value!r} given with {ours}={group[ours]!r} (timm's name for the same "
                         "option; give one of them)")


def _adamw_lr_as_scale(group: dict[str, Any], default_lr: Any) -> dict[str, Any]:
    """The group with `adamw_lr` (AdamW's learning rate when lr is where it started, accepted as a shorthand) turned
    into the `adamw_lr_scale` a group keeps: AdamW's lr is always lr * adamw_lr_scale, so whatever moves lr (a
    scheduler, ReduceLROnPlateau, a hand-set group["lr"]) moves AdamW's by the same factor. Where lr started is the
    `initial_lr` torch's schedulers put in each group, else the group's lr (`default_lr` where it has none): so an
    adamw_lr that a wrapper sets again before each step (ZeroRedundancyOptimizer copies its constructor's options
    into the optimizer it wraps) means the same scale at every step of a schedule, and so does an old checkpoint's
    absolute adamw_lr, from before adamw_lr_scale."""
    if "adamw_lr" not in group:
        return group
    reference_lr = group.get("initial_lr", group.get("lr", default_lr))
    adamw_lr = group["adamw_lr"]
    group = {key: value for key, value in group.items() if key != "adamw_lr"}
    if adamw_lr is None:
        return group
    if group.get("adamw_lr_scale") is not None:
        raise ValueError(f"Invalid adamw_lr: {adamw_lr!r} given with adamw_lr_scale={group['adamw_lr_scale']!r} "
                         "(expected one of them: adamw_lr_scale = adamw_lr / lr)")
    _check_nonnegative("adamw_lr", adamw_lr)
    lr = as_real(reference_lr)
    if lr is None or not lr > 0:
        raise ValueError(f"Invalid adamw_lr: {adamw_lr!r} is kept relative to the lr its group started at, "
                         f"which is {reference_lr!r} "
                         "(expected lr > 0; or give adamw_lr_scale)")
    return {**group, "adamw_lr_scale": as_real(adamw_lr) / lr}


# Options whose None stands for a value of their own, which groups keep instead (adamw_weight_decay's None, "as
# weight_decay", follows weight_decay and stays None).
_NONE_MEANS = {"adamw_lr_scale": 1.0, "adamw_betas": (0.9, 0.95)}
# Options of the optimizer as a whole: attributes, not group keys.
_OPTIMIZER_OPTIONS = ("offload", "process_group", "qk_clip", "qk_clip_threshold")


def param_names(group: dict[str, Any]) -> list[str]:
    """The group's parameter names for messages: `param_names`, else their positions (#0, #1, ...)."""
    return group.get("param_names") or [f"#{i}" for i in range(len(group["params"]))]


def _none_resolved(group: dict[str, Any]) -> dict[str, Any]:
    """The group with the `_NONE_MEANS` options it gives as None set to what None stands for."""
    return {**group, **{key: value for key, value in _NONE_MEANS.items() if key in group and group[key] is None}}


def _refuse_optimizer_options(group: dict[str, Any]) -> None:
    for key in _OPTIMIZER_OPTIONS:
        if key in group:
            raise ValueError(f"Invalid param group key {key!r}: {key} is an option of the whole optimizer, not of a "
                             "param group (give it to Muon(...))")


def entered(group: dict[str, Any], default_lr: Any) -> dict[str, Any]:
    """The group in the form groups keep: timm's spellings, `adamw_lr` and the Nones of `_NONE_MEANS` resolved
    (`default_lr`: the lr of a group that gives none)."""
    _refuse_optimizer_options(group)
    return _none_resolved(_adamw_lr_as_scale(_from_timm_spellings(group), default_lr))


# Keys a group only enters with, each with the key `entered` turns it into (or None: refused).
_ENTRY_KEYS = {**_TIMM_KEYS, "use_fallback": "use_muon", "algo": "normalization", "adamw_lr": "adamw_lr_scale",
               **dict.fromkeys(_OPTIMIZER_OPTIONS)}


def needs_reentry(group: dict[str, Any]) -> bool:
    """Whether the group holds a key or value it could only enter with (a training loop setting timm's `betas`,
    `adamw_lr`, or `adamw_betas = None` between steps), which it would keep and never read. Asked as a compiled step
    traces it too: dynamo cannot trace set operations on a dict's keys."""
    return (any(key in group for key in _ENTRY_KEYS) or any(group.get(key, 0) is None for key in _NONE_MEANS)
            or any(is_one_of(group.get(key), (value,)) for key, value in _TIMM_VALUES))


def reentered(group: dict[str, Any], default_lr: Any) -> dict[str, Any]:
    """The group as if it entered with its keys and values (`entered`): the key set last is the one meant, so it
    replaces the one the group kept."""
    replaced = {ours for key, ours in _ENTRY_KEYS.items() if group.get(key) is not None}
    return entered({key: value for key, value in group.items() if key not in replaced}, default_lr)


def reenter_(group: dict[str, Any]) -> None:
    """`reentered` in place, for a group that `needs_reentry`."""
    as_entered = reentered(group, group["lr"])
    for key in group.keys() - as_entered.keys():
        del group[key]
    group.update(as_entered)


def put_back_(groups_before: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    """Each group as it was before a step re-entered it (`reenter_`), the step having been refused."""
    for group, before in groups_before:
        group.clear()
        group.update(before)


# torch.optim's flags that change what a step computes, which Muon does not implement: a group may carry them (a
# torch optimizer's state dict has them) only switched off, or a group asking for one would be stepped without it.
UNSUPPORTED_FLAGS = ("maximize", "amsgrad", "differentiable")


def validate_group(group: dict[str, Any], at_step: bool = False) -> None:
    """Every option of the group; at step time a capturable group's tensor values are not read (a host sync)."""
    for flag in UNSUPPORTED_FLAGS:
        if group.get(flag, False) is not False:
            raise ValueError(f"Invalid {flag}: {group[flag]!r} (Muon does not support {flag}; expected False or "
                             "no such key in the group)")
    check_bool("capturable", group["capturable"])
    check_bool("verbose", group["verbose"])
    # bool(): torch 2.15's compiler traces `capturable` as a value that only answers truth tests, not `not`.
    read_tensors = not (at_step and bool(group["capturable"]))
    for key in ("lr", "weight_decay", "eps", "adamw_eps"):
        _check_nonnegative(key, group[key], read_tensors)
    if not as_real(group["eps"]) > 0:
        raise _invalid("eps", group["eps"], "a number > 0")
    _check_fraction("momentum", group["momentum"])
    check_bool("nesterov", group["nesterov"])
    _check_nonnegative("adamw_lr_scale", group["adamw_lr_scale"])
    if group["adamw_weight_decay"] is not None:
        _check_nonnegative("adamw_weight_decay", group["adamw_weight_decay"])
    betas = group["adamw_betas"]
    # Types as a tuple, here and in every check a step runs: torch 2.9's compiler cannot trace a union (`tuple | list`).
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid adamw_betas: {betas!r} (expected two numbers in [0, 1))")
    for index, beta in enumerate(betas):
        if as_real(beta) is None or not 0 <= as_real(beta) < 1:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta} (adamw_betas: expected numbers in "
                             "[0, 1))")
    steps = check_ns_steps(group["ns_steps"])
    resolve_coefficients(group["ns_coefficients"], steps, group["preconditioner"], option="ns_coefficients")
    if not is_one_of(group["adjust_lr_fn"], (*ADJUST_LR_FNS, None)):
        raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported (adjust_lr_fn: "
                         f"expected one of {', '.join(map(repr, (*ADJUST_LR_FNS, None)))})")
    check_choice("conv_mode", group["conv_mode"], CONV_MODES)
    check_choice("ns_algorithm", group["ns_algorithm"], NS_ALGORITHMS)
    check_choice("preconditioner", group["preconditioner"], PRECONDITIONERS)
    check_choice("normalization", group["normalization"], NORMALIZATIONS)
    check_choice("state_dtype", group["state_dtype"], STATE_DTYPES)
    try:
        check_safety_factor(as_real(group["safety_factor"]))
    except ValueError:
        raise _invalid("safety_factor", group["safety_factor"], "a finite number >= 1") from None
    check_bool("scale_eps", group["scale_eps"])
    check_bool("normalize_spatial", group["normalize_spatial"])
    check_choice("param_layout", group["param_layout"], PARAM_LAYOUTS)
    check_bool("use_muon", group["use_muon"], optional=True)
    check_float_dtype("ns_dtype", group["ns_dtype"], optional=True)
    check_float_dtype("comm_dtype", group["comm_dtype"])
    check_chunk_size(group["chunk_size"])
