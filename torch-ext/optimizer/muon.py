"""`Muon`: the optimizer class. Validation, parameter groups, state and the step's orchestration."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import operator
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.nn.parameter import is_lazy
from torch.optim import Optimizer

from .clipping import (CheckedGradients, check_max_norm, clip_by_tensor_norms_, clip_grad_norm_, reads_once,
                       tensor_norms_serve)
from .coefficients import Coefficients, resolve_coefficients
from .distributed.dtensors import (any_dtensor, is_dtensor, local_or_none, local_tensor, placed_like, splits_last_dim,
                                  zeros_like_resized)
from .distributed.finite import found_inf_flags
from .distributed.layout import shard_positions
from .distributed.step import check_spread_param, distributed_muon_update, is_spread
from .functional import ADJUST_LR_FNS, AdamWTensors, MuonTensors, Rates, by_device
from .newton_schulz import NS_ALGORITHMS, PRECONDITIONERS, Orthogonalizer, check_safety_factor
from .normalization import NORMALIZATIONS, moment_dtype, second_moment_shape
from .option_values import (as_integer, as_real, check_bool, check_choice, check_chunk_size, check_float_dtype,
                            check_ns_steps, is_one_of, is_real_scalar)
from .offload import (OFFLOAD_TARGETS, StagedUpdates, home_device, keep_at_home, staged_adamw_update,
                      staged_muon_update)
from .precision import default_ns_dtype, ns_dtype_choice, warn_if_slow, without_autocast
from .qk_clip import (DEFAULT_THRESHOLD, QKClipLayer, check_qk_logits, check_threshold, clip_checked_,
                      resolve_layers)
from .routing import CONV_MODES, PARAM_LAYOUTS, MatrixView, check_forced_muon, muon_view
from .state_precision import (CODES_KEYS, MOMENT_KEYS, STATE_DTYPES, codes_key, is_quantized, rounds_stochastically,
                              scale_key, scales_shape, store_, stored_dtype, working_copy)
from .workspace import Workspace

# What a copied or unpickled optimizer holds in place of the process group it was built with: a process group
# belongs to its process and cannot be saved, so the copy's step asks for one instead of running single-device.
_PROCESS_GROUP_NOT_SAVED = "process group not saved"

logger = logging.getLogger(__name__)

# State that must keep its own dtype through load_state_dict (torch casts other floating state to the parameter's
# dtype, which would turn a step count or a float32 second moment into bf16 for a bf16 parameter).
_EXACT_STATE_DTYPES: dict[str, Callable[[torch.dtype], torch.dtype]] = {
    "step": lambda _: torch.float32, "update_step": lambda _: torch.float32, "update_sq": moment_dtype,
    "nonfinite_skips": lambda _: torch.int64, "rounding_count": lambda _: torch.int64}
_SCALAR_STATE_KEYS = ("step", "update_step", "nonfinite_skips", "rounding_count")


def _learning_rate(value: Any) -> float | Tensor:
    """lr as the update math takes it: a tensor lr stays a tensor, so that a compiled step never reads its value
    (which would break the graph, and recompile whenever a schedule moves it)."""
    return value.reshape(()) if isinstance(value, Tensor) else float(value)


# torch.optim's wording for the options it shares with us, which is what users search for.
_TORCH_WORDING = {"lr": "learning rate", "eps": "epsilon value", "weight_decay": "weight_decay value",
                  "momentum": "momentum value"}


def _invalid(name: str, value: Any, expected: str) -> ValueError:
    """`Invalid learning rate: -1 (lr: expected ...)`: torch's words where torch has the option, then ours."""
    if name in _TORCH_WORDING:
        return ValueError(f"Invalid {_TORCH_WORDING[name]}: {value} ({name}: expected {expected})")
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


# Options whose values may be torch dtypes, which a state dict holds by name ("torch.bfloat16"): DCP's full state dict
# (`StateDictOptions(full_state_dict=True)`, as Accelerate saves FSDP2 models) takes only tensors, numbers, strings,
# lists, dicts and None, and refused every Muon state dict ("Unexpected value type <class 'torch.dtype'>").
_DTYPE_OPTIONS = ("ns_dtype", "comm_dtype", "state_dtype")


def _dtypes_named(group: dict[str, Any]) -> dict[str, Any]:
    return {key: str(value) if key in _DTYPE_OPTIONS and isinstance(value, torch.dtype) else value
            for key, value in group.items()}


def _dtypes_from_names(group: dict[str, Any]) -> dict[str, Any]:
    """A saved group with the dtypes `_dtypes_named` named as dtypes again (state_dtype's "int8" is no dtype's name)."""
    return {key: _named_dtype(key, value)
            if key in _DTYPE_OPTIONS and isinstance(value, str) and value.startswith("torch.") else value
            for key, value in group.items()}


def _named_dtype(key: str, name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Invalid {key}: {name!r} names no torch dtype")
    return dtype


def _param_names(group: dict[str, Any]) -> list[str]:
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


def _entered(group: dict[str, Any], default_lr: Any) -> dict[str, Any]:
    """The group in the form groups keep: timm's spellings, `adamw_lr` and the Nones of `_NONE_MEANS` resolved
    (`default_lr`: the lr of a group that gives none)."""
    _refuse_optimizer_options(group)
    return _none_resolved(_adamw_lr_as_scale(_from_timm_spellings(group), default_lr))


# Keys a group only enters with, each with the key `_entered` turns it into (or None: refused).
_ENTRY_KEYS = {**_TIMM_KEYS, "use_fallback": "use_muon", "algo": "normalization", "adamw_lr": "adamw_lr_scale",
               **dict.fromkeys(_OPTIMIZER_OPTIONS)}


def _needs_reentry(group: dict[str, Any]) -> bool:
    """Whether the group holds a key or value it could only enter with (a training loop setting timm's `betas`,
    `adamw_lr`, or `adamw_betas = None` between steps), which it would keep and never read. Asked as a compiled step
    traces it too: dynamo cannot trace set operations on a dict's keys."""
    return (any(key in group for key in _ENTRY_KEYS) or any(group.get(key, 0) is None for key in _NONE_MEANS)
            or any(is_one_of(group.get(key), (value,)) for key, value in _TIMM_VALUES))


def _reentered(group: dict[str, Any], default_lr: Any) -> dict[str, Any]:
    """The group as if it entered with its keys and values (`_entered`): the key set last is the one meant, so it
    replaces the one the group kept."""
    replaced = {ours for key, ours in _ENTRY_KEYS.items() if group.get(key) is not None}
    return _entered({key: value for key, value in group.items() if key not in replaced}, default_lr)


def _reenter_(group: dict[str, Any]) -> None:
    """`_reentered` in place, for a group that `_needs_reentry`."""
    entered = _reentered(group, group["lr"])
    for key in group.keys() - entered.keys():
        del group[key]
    group.update(entered)


def _put_back_(groups_before: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    """Each group as it was before a step re-entered it (`_reenter_`), the step having been refused."""
    for group, before in groups_before:
        group.clear()
        group.update(before)


# torch.optim's flags that change what a step computes, which Muon does not implement: a group may carry them (a
# torch optimizer's state dict has them) only switched off, or a group asking for one would be stepped without it.
_UNSUPPORTED_FLAGS = ("maximize", "amsgrad", "differentiable")


def _validate_group(group: dict[str, Any], at_step: bool = False) -> None:
    """Every option of the group; at step time a capturable group's tensor values are not read (a host sync)."""
    for flag in _UNSUPPORTED_FLAGS:
        if group.get(flag, False) is not False:
            raise ValueError(f"Invalid {flag}: {group[flag]!r} (Muon does not support {flag}; expected False or "
                             "no such key in the group)")
    check_bool("capturable", group["capturable"])
    check_bool("verbose", group["verbose"])
    read_tensors = not (at_step and group["capturable"])
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
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"Invalid adamw_betas: {betas!r} (expected two numbers in [0, 1))")
    for index, beta in enumerate(betas):
        if as_real(beta) is None or not 0 <= as_real(beta) < 1:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta} (adamw_betas: expected numbers in "
                             "[0, 1))")
    steps = check_ns_steps(group["ns_steps"])
    try:
        resolve_coefficients(group["ns_coefficients"], steps, group["preconditioner"])
    except ValueError as error:
        raise ValueError(f"Invalid ns_coefficients: {error}") from None
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


# Per-element state has the parameter's shape; counters are scalars. Anything else would make the fused kernels read
# and write outside the parameter's memory, so a checkpoint that disagrees is refused before it is loaded.
_SCALE_STATE_KEYS = tuple(scale_key(key) for key in MOMENT_KEYS)
_MOMENTUM_SCALES, _EXP_AVG_SCALES, _EXP_AVG_SQ_SCALES = _SCALE_STATE_KEYS  # in MOMENT_KEYS' order
_MOMENTUM_CODES, _EXP_AVG_CODES, _EXP_AVG_SQ_CODES = CODES_KEYS
_MOMENT_STATE_KEYS = (*MOMENT_KEYS, *CODES_KEYS, *_SCALE_STATE_KEYS)
# State created together, so saved together: lazy initialisation keys on one of each (AdamW's "step", a
# normalization's "update_sq"), and without the others the next step would restart them or fail part way.
_SAVED_TOGETHER = ((("step", "exp_avg", "exp_avg_sq"), "AdamW state"),
                   (("update_sq", "update_step"), "a second moment's state"))
# Each part's moments, each with the keys of its 8-bit codes and their scales (formed once: a step asks for them per
# parameter).
_MUON_MOMENTS = (("momentum_buffer", _MOMENTUM_CODES, _MOMENTUM_SCALES),)
_ADAMW_MOMENTS = (("exp_avg", _EXP_AVG_CODES, _EXP_AVG_SCALES), ("exp_avg_sq", _EXP_AVG_SQ_CODES, _EXP_AVG_SQ_SCALES))


# The state a step's items take, in the order `Muon._init_group` lists it and `Muon._gather` reads it.
_MUON_STATE = ("momentum_buffer", "nonfinite_skips", "rounding_count", _MOMENTUM_SCALES, "update_sq", "update_step")
_ADAMW_STATE = ("exp_avg", "exp_avg_sq", "step", "nonfinite_skips", "rounding_count", _EXP_AVG_SCALES,
                _EXP_AVG_SQ_SCALES)


def _state_keys(group: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, ...]:
    """`keys` with None for the state this group's options do not use: a rounding count kept from an earlier
    state_dtype, a second moment from an earlier normalization. (No state has a None key: its tensor is None.)"""
    return _used_state_keys(group["state_dtype"], group["normalization"], keys)


@functools.cache  # asked twice per group and step (`_init_group`, which runs eagerly under torch.compile too)
def _used_state_keys(state_dtype: torch.dtype | str | None, normalization: str | None,
                     keys: tuple[str, ...]) -> tuple[str | None, ...]:
    unused = set()
    if not rounds_stochastically(state_dtype):
        unused.add("rounding_count")
    if normalization is None:
        unused.update(("update_sq", "update_step"))
    return tuple(None if key in unused else key for key in keys)


def _param_state_keys(keys: tuple[str | None, ...], state: Mapping[str, Any] | None) -> tuple[str | None, ...]:
    """The keys a step lists a parameter's state under (`keys`: its part's, `_state_keys`): its moments' 8-bit codes'
    where it keeps codes (a part's moments are in one form; its first moment's key comes first)."""
    return _keys_with_codes(keys) if state is not None and codes_key(keys[0]) in state else keys


@functools.cache
def _keys_with_codes(keys: tuple[str | None, ...]) -> tuple[str | None, ...]:
    return tuple(codes_key(key) if key in MOMENT_KEYS else key for key in keys)


def _check_group_sizes(saved_groups: list[dict[str, Any]], param_groups: list[dict[str, Any]]) -> None:
    """torch's checks of the groups' number and sizes, with torch's messages, before the checks that pair the saved
    groups and parameters with these (their errors would name a state mismatch instead)."""
    if len(saved_groups) != len(param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(saved["params"]) != len(group["params"]) for saved, group in zip(saved_groups, param_groups)):
        raise ValueError("loaded state dict contains a parameter group that doesn't match the size of optimizer's "
                         "group")


def _check_saved_state(state_dict: dict[str, Any], param_groups: list[dict[str, Any]]) -> None:
    saved_ids = chain.from_iterable(group["params"] for group in state_dict["param_groups"])
    params = chain.from_iterable(group["params"] for group in param_groups)
    for saved_id, param in zip(saved_ids, params):
        saved = state_dict["state"].get(saved_id, {})
        for keys, what in _SAVED_TOGETHER:
            present = [key for key in keys if key in saved or codes_key(key) in saved]
            if present and len(present) < len(keys):
                missing = [key for key in keys if key not in present]
                raise ValueError(f"Invalid state_dict: parameter {saved_id!r} has {what} {present} without {missing}")
        _check_saved_moments(saved_id, saved)
        if any(key in saved for key in CODES_KEYS) and "rounding_count" not in saved:
            # 8-bit codes are always rounded at random: without their count the random bits would start over.
            raise ValueError(f"Invalid state_dict: parameter {saved_id!r} has 8-bit codes without 'rounding_count'")
        if saved and is_lazy(param):
            raise ValueError(f"Invalid state_dict: parameter {saved_id!r} has state, and the parameter it loads into "
                             "is not materialized yet (a lazy module's): run one forward pass before loading")
        misshapen = None if not saved else _misshapen_state(saved, param.shape)
        if misshapen is not None:
            key, found, expected = misshapen
            raise ValueError(f"Invalid state_dict: state {key!r} of parameter {saved_id!r} is {found}, expected a "
                             f"tensor of shape {expected} (the parameter it loads into has shape "
                             f"{tuple(param.shape)})")


def _misshapen_state(state: Mapping[str, Any], shape: torch.Size) -> tuple[str, Any, tuple[int, ...]] | None:
    """The first per-element or scalar state entry that is not a tensor of the shape a parameter of `shape` needs:
    its key, its shape (or type) and the shape expected."""
    for key, value in state.items():
        if key in MOMENT_KEYS or key in CODES_KEYS:
            expected = shape
        elif key in _SCALE_STATE_KEYS:
            expected = torch.Size(scales_shape(shape))
        elif key in _SCALAR_STATE_KEYS:
            expected = torch.Size()
        else:
            continue
        if not isinstance(value, Tensor) or value.shape != expected:
            return key, tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__, tuple(expected)
    return None


def _check_saved_moments(saved_id: Any, saved: dict[str, Any]) -> None:
    """A parameter's saved state holds its moments (state without them would restart them from zero), each a float
    tensor under its key, or 8-bit codes (int8) under theirs with their block scales beside them (codes read without
    their scales would be taken as values, and values with scales as codes)."""
    where = f"Invalid state_dict: parameter {saved_id!r} has"
    if saved and not any(key in saved for key in (*MOMENT_KEYS, *CODES_KEYS)):
        raise ValueError(f"{where} state {sorted(saved)} without its moments (one of {', '.join(MOMENT_KEYS)}, or "
                         f"their 8-bit codes {', '.join(CODES_KEYS)})")
    for key, codes_key_, scales_key in (*_MUON_MOMENTS, *_ADAMW_MOMENTS):
        values, codes, scales = saved.get(key), saved.get(codes_key_), saved.get(scales_key)
        if values is not None and codes is not None:
            raise ValueError(f"{where} both {key!r} and its 8-bit codes {codes_key_!r} (as where torch merged a "
                             "saved form into another one's state: resume with the saved state_dtype, in a layout "
                             "that keeps it, then change it)")
        if codes is None and scales is not None:
            raise ValueError(f"{where} {scales_key!r} without the codes they scale ({codes_key_!r})")
        if isinstance(codes, Tensor) and codes.dtype != torch.int8:
            raise ValueError(f"{where} {codes_key_!r} of dtype {codes.dtype} (8-bit codes are torch.int8)")
        if codes is not None and scales is None:
            raise ValueError(f"{where} 8-bit codes {codes_key_!r} without their scales {scales_key!r}")
        if isinstance(values, Tensor) and not values.is_floating_point():
            raise ValueError(f"{where} {key!r} of dtype {values.dtype} (expected a float tensor; 8-bit codes go under "
                             f"{codes_key_!r})")


def _codes_under_their_keys(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved parameter's state with 8-bit codes found under their moment's own key (where versions before
    2026-11-27 kept them) moved to theirs."""
    moved = {key: codes_key(key) for key in MOMENT_KEYS
             if isinstance(saved.get(key), Tensor) and saved[key].dtype == torch.int8 and codes_key(key) not in saved}
    return {moved.get(key, key): value for key, value in saved.items()} if moved else saved


def _moment_form(param: Tensor, state_dtype: torch.dtype | str | None) -> tuple[torch.dtype, bool]:
    """The dtype a parameter's moments are stored in, and whether as 8-bit codes with block scales. "int8" applies to
    tensors of 2 or more dims whose last dim each rank holds whole; vectors, scalars and shards of a split last dim
    keep bfloat16 (a vector's bytes are few, and blocks cut by a shard boundary would not survive a reshard)."""
    if state_dtype is None:  # asked of every parameter every step: the default answered first
        return param.dtype, False
    if is_quantized(state_dtype) and (param.dim() < 2 or splits_last_dim(param)):
        state_dtype = torch.bfloat16
    return stored_dtype(param.dtype, state_dtype), is_quantized(state_dtype)


def _keep_moments(state: dict[str, Any], param: Tensor, moments: tuple[tuple[str, str, str], ...],
                  form: tuple[torch.dtype, bool], rounding_count: Tensor | None) -> None:
    """The `moments` (each key with its codes' and scales' keys) in `form` (see `_moment_form`): created as zeros, or
    converted from another form (the group's state_dtype was changed, or a checkpoint saved under another one or
    another sharding was loaded)."""
    dtype, quantized = form
    for key, codes, scales_key in moments:
        kept_key = codes if quantized else key
        moment = state.get(kept_key)
        if moment is not None and moment.dtype == dtype:
            continue
        scales = state.pop(scales_key, None)
        stored = state.pop(codes if codes in state else key, None)
        previous = None if stored is None else working_copy(key, local_tensor(stored), local_or_none(scales))
        state[kept_key] = torch.zeros_like(param, dtype=dtype, memory_format=torch.contiguous_format)
        if quantized:
            state[scales_key] = zeros_like_resized(param, scales_shape(param.shape), torch.float32)
        if previous is None:
            continue
        if quantized:
            store_([key], [local_tensor(state[codes])], [local_tensor(state[scales_key])], [previous],
                   [rounding_count], torch.ones(1, device=previous.device), [shard_positions(param)])
        else:
            local_tensor(state[key]).copy_(previous)


def _view(group: dict[str, Any], param: Tensor) -> MatrixView | None:
    """The matrix view Muon steps `param` in under its group's routing options, or None where AdamW steps it."""
    use_muon = group["use_muon"]
    # Answered before `muon_view`'s kept lookup, which hashes the shape: without this, an AdamW-only group of GPT-2
    # small's 97 AdamW tensors (every dim / 96) took ~0.1 ms more a step (2-core Xeon).
    if use_muon is False:
        return None
    return muon_view(param.shape, use_muon, group["param_layout"], group["conv_mode"])


def _muon_settings(group: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """What `muon_update` takes from a group whose Muon parameters are on `device` (the first, where several)."""
    orthogonalizer = Orthogonalizer(
        tuple(resolve_coefficients(group["ns_coefficients"], as_integer(group["ns_steps"]), group["preconditioner"])),
        as_real(group["eps"]), group["ns_dtype"] or default_ns_dtype(device),
        group["ns_algorithm"], group["preconditioner"], as_real(group["safety_factor"]), group["scale_eps"],
        dtype_is_default=group["ns_dtype"] is None)
    return dict(lr=_learning_rate(group["lr"]), weight_decay=as_real(group["weight_decay"]),
                momentum=as_real(group["momentum"]), nesterov=group["nesterov"], orthogonalizer=orthogonalizer,
                adjust_lr_fn=group["adjust_lr_fn"], normalize_spatial=group["normalize_spatial"],
                normalization=group["normalization"], normalization_beta=as_real(group["adamw_betas"][1]))


# The settings the Muon updates take one per parameter, where groups share a call.
_PER_ITEM_SETTINGS = ("lr", "weight_decay")
# Updates waiting for the groups that share them: key -> (the update, each group's settings and items).
_Pending = dict[tuple, tuple[Callable[..., None], list[tuple[dict[str, Any], list[MuonTensors] | list[AdamWTensors]]]]]


def _run_pending(pending: _Pending) -> None:
    """Each pending update, once, on the items of every group that shares it, each item with its group's rates."""
    for update, members in pending.values():
        settings, items = members[0]
        if len(members) > 1:
            items = [item for _, chosen in members for item in chosen]
            settings = {**settings, **{name: [other[name] for other, chosen in members for _ in chosen]
                                       for name in _PER_ITEM_SETTINGS}}
        update(items, **settings)


def _shared_update_key(settings: dict[str, Any]) -> tuple:
    """Equal for groups whose updates (Muon's, AdamW's) may share one call: all their settings but lr and weight
    decay equal."""
    return tuple((name, value.recipe if isinstance(value, Orthogonalizer) else value)
                 for name, value in settings.items() if name not in _PER_ITEM_SETTINGS)


# Option values that cannot change in place: a group holding only these keeps what a step derived from it while each
# value stays the very same object (a scheduler that sets `lr` puts a new one there).
_IMMUTABLE_OPTION_TYPES = (bool, int, float, str, type(None), torch.dtype)


def _immutable(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(map(_immutable, value))
    return isinstance(value, _IMMUTABLE_OPTION_TYPES)


@dataclass
class _Kept:
    """What steps derive from a group whose options are the very objects `options` holds: that they passed the
    checks, and the Muon update's settings per device. An unchanged group cost ~6 µs a step in checks and ~7 in
    settings (2-core Xeon), a fifth of a millisecond for a model with a param group per block."""

    options: tuple
    size: int  # the group's number of keys: one more is one a group only enters with (`_reenter_`)
    muon_settings: dict[torch.device, dict[str, Any]] = field(default_factory=dict)

    def holds(self, group: dict[str, Any], options: tuple) -> bool:
        """Whether the group still has these options and no torch flag Muon refuses switched on (a group loaded
        from a torch optimizer's state dict holds them switched off: not an option, so not in `options`)."""
        return (len(group) == self.size and all(map(operator.is_, options, self.options))
                and not any(map(group.get, _UNSUPPORTED_FLAGS)))


# The options that decide how a group's parameters are routed and what state they keep (`_view`, `_state_keys`,
# `Muon._prepared_state`): held items hold while these stay the same objects, whatever the others do (a scheduler
# sets a new `lr` at every step).
_LAYOUT_OPTIONS = ("use_muon", "param_layout", "conv_mode", "state_dtype", "normalization")


@dataclass
class _HeldItems:
    """A group's step items as a step gathered them (`Muon._gather`), kept for the steps after: while the group's
    parameters are the same, of the same dtypes (`model.double()` changes them in place), with gradients where they
    had them, of those dtypes and shapes (`.grad.data` can change them), its `_LAYOUT_OPTIONS` the same, and each
    parameter's state holds the same tensors under the same keys, a step takes these items with the new gradients
    instead of checking, preparing and gathering each parameter's state again. GPT-2 small's 97 AdamW tensors at
    1/96 width: the check, preparation and gathering took ~320 µs of the AdamW part's ~600 µs of host time, this
    check ~70 (2-core AMD EPYC). A state tensor replaced or given new storage (`.data`, as moving state to the host
    and back does, maybe in another dtype), a parameter's state dropped or loaded, a layout option changed: the step
    gathers afresh, and checks the state (a kernel refused a moment of another shape or dtype part way through)."""

    params: list[Tensor]  # the group's own list
    options: tuple  # the group's _LAYOUT_OPTIONS
    state: Mapping[Tensor, dict[str, Any]]  # the optimizer's state mapping
    # Per parameter: itself, its dtype and shape, and with a gradient, its state dict, the keys its item was read from,
    # their values then (`_MUON_STATE`, `_ADAMW_STATE`, as `_state_keys` leaves them) and its item.
    entries: list[tuple[Tensor, torch.dtype, torch.Size, dict[str, Any] | None, tuple[str | None, ...],
                        tuple[Tensor | None, ...], MuonTensors | AdamWTensors | None]]
    muon_items: list[MuonTensors]
    adamw_items: list[AdamWTensors]
    state_tensors: list[Tensor] = field(init=False, default_factory=list)  # the plain state tensors of the values
    addresses: tuple[int, ...] | None = field(init=False, default=None)  # where they lay after the step

    def note_addresses(self) -> None:
        """Where the state tensors lie at the end of the step that gathered the items (offload packs them into its
        pinned memory during that step)."""
        self.state_tensors = [value for *_, values, _ in self.entries for value in values
                              if value is not None and not is_dtensor(value)]
        self.addresses = tuple(map(Tensor.data_ptr, self.state_tensors))

    def items_for(self, group: dict[str, Any],
                  state: Mapping[Tensor, dict[str, Any]]) -> tuple[list[MuonTensors], list[AdamWTensors]] | None:
        """The items with the parameters' gradients now, or None where anything they were gathered from changed (or
        a gradient is sparse: the step's check then refuses it)."""
        params = group["params"]
        if (params is not self.params or len(params) != len(self.entries) or state is not self.state
                or not all(map(operator.is_, map(group.get, _LAYOUT_OPTIONS), self.options))
                or self.addresses is None or tuple(map(Tensor.data_ptr, self.state_tensors)) != self.addresses):
            return None
        for param, (held, dtype, shape, param_state, keys, values, item) in zip(params, self.entries):
            grad = param.grad
            if held is not param or param.dtype is not dtype or (grad is None) != (item is None):
                return None
            if item is None:
                continue
            # A gradient of another dtype or shape goes to the full check (`Muon._check_gradients`), which refuses it,
            # and so does a parameter resized in place (`Muon._check_state_shapes`).
            if (grad.is_sparse or grad.dtype is not dtype or grad.shape != shape or param.shape != shape
                    or state.get(param) is not param_state
                    or not all(map(operator.is_, map(param_state.get, keys), values))):
                return None
            item.grad = grad
        return self.muon_items, self.adamw_items

    def release_gradients(self) -> None:
        """Let go of the step's gradients, which `zero_grad` may free before the next step: held, they would stay
        alive through its backward pass."""
        for item in chain(self.muon_items, self.adamw_items):
            item.grad = None  # type: ignore[assignment]


def _local_adamw_item(item: AdamWTensors) -> AdamWTensors:
    """A DTensor parameter's AdamW tensors as this rank's shards (plain tensors pass through)."""
    if not is_dtensor(item.param):
        return item
    positions = None if item.rounding_count is None else shard_positions(item.param)
    return replace(item, param=local_tensor(item.param), grad=local_tensor(placed_like(item.grad, item.param)),
                   exp_avg=local_tensor(item.exp_avg), exp_avg_sq=local_tensor(item.exp_avg_sq),
                   exp_avg_scales=local_or_none(item.exp_avg_scales),
                   exp_avg_sq_scales=local_or_none(item.exp_avg_sq_scales), rounding_positions=positions)


def _aligned_by_name(state_dict: dict[str, Any], param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """The state dict with each group's parameters in this optimizer's order, matched by `param_names` where both
    sides have them (torch matches by position, which breaks when a model lists its parameters in another order)."""
    saved_groups = state_dict["param_groups"]
    named = len(saved_groups) == len(param_groups) and all(
        group.get("param_names") for group in (*saved_groups, *param_groups))
    if not named:
        return state_dict
    aligned = []
    for index, (saved, current) in enumerate(zip(saved_groups, param_groups)):
        id_by_name = dict(zip(saved["param_names"], saved["params"]))
        names = current["param_names"]
        if set(id_by_name) != set(names):
            raise ValueError(f"Invalid state_dict: parameter group {index} names "
                             f"{sorted(set(id_by_name) - set(names))} that this optimizer's group lacks, and lacks "
                             f"{sorted(set(names) - set(id_by_name))}")
        aligned.append({**saved, "params": [id_by_name[name] for name in names], "param_names": list(names)})
    return {**state_dict, "param_groups": aligned}


class Muon(Optimizer):
    """Muon for matrices (momentum, then Newton-Schulz orthogonalization), AdamW for every other parameter.

    Routing: a group's ``use_muon`` forces Muon (True) or AdamW (False); without it, matrices, conv weights and 3D
    expert banks that are not degenerate go to Muon and the rest (1D, scalars, thin shapes) to AdamW. Use
    :func:`muon_param_groups` to also send embeddings and the output head to AdamW.

    Args:
        params: parameters or parameter groups (dicts); groups may set any option below, plus ``use_muon``
            (None/True/False) and ``param_layout`` ("auto", "conv" for Conv1d weights, "experts").
        lr: learning rate. weight_decay: decoupled (``p *= 1 - lr * weight_decay``), as torch.optim.Muon does.
        momentum, nesterov: the momentum buffer is ``lerp(grad, 1 - momentum)``; Nesterov orthogonalizes
            ``lerp(grad, buffer, momentum)``.
        ns_steps, ns_coefficients: Newton-Schulz iterations and their (a, b, c) coefficients: "polar_express",
            "quintic", "original", or a list of triples (the last repeats).
        eps: lower clamp of the Frobenius norm before the iteration.
        adjust_lr_fn: "match_rms_adamw" (0.2 * sqrt(max(out, in))), "original" (sqrt(max(1, out / in))),
            "spectral" (sqrt(out / in); timm's "rms_to_rms"), "rsqrt_in" (1 / sqrt(in)) or None (no scaling).
        ns_dtype: Newton-Schulz compute dtype; None is what the device multiplies fastest (`default_ns_dtype`):
            bfloat16 on GPUs and on CPUs with fast bf16 products (AMX; AVX512-BF16 on AMD cores), float32 on other
            CPUs, and on those, for a lone matrix under 2^23 (AMX) or 2^22 (AVX512-BF16) multiply-adds a product
            (`matrix_ns_dtype`).
        ns_algorithm: "standard" (three products of the matrix's size per step), "gram" (the same polynomial
            applied through the matrix's Gram matrix: 1.7-2.1x faster on 1:4 matrices in float32) or "auto" (per
            shape, "gram" where it takes fewer FLOPs, from an aspect ratio of about 1.5, by 3M or more, and the
            iteration is float32 or float64; "standard" otherwise).
        preconditioner: None or "aol": rows scaled by (|X Xᵀ| 1)^(-1/2) before the iteration instead of relying on
            the Frobenius scaling alone (Turbo-Muon); the "polar_express" schedule then assumes it, and 4 steps reach
            the accuracy 5 reach without it on well-conditioned matrices.
        safety_factor: the Frobenius norm is multiplied by it before the division (timm's option; >= 1).
        scale_eps: timm's μP option (arXiv 2512.05620): eps * sqrt(in / out) is added to the norm instead of
            clamping it.
        capturable: a step safe to capture in a CUDA graph (timm's and torch's option): tensor option values (a
            tensor lr) are not read at step time. The step never syncs with the host in any case.
        verbose: log (INFO, logger "optimizer.muon" under the package's name) where each parameter goes and why.
        normalization: None, "neuron" (NorMuon: each output row of the orthogonalized update divided by the root of
            a running mean of its squares) or "element" (AdaMuon: the same per entry; timm's algo="adamuon"). The
            running mean's beta is adamw_betas[1], as timm shares it; under "match_rms_adamw" the normalized update
            is rescaled to RMS 0.2, as both papers do. The second moment (state "update_sq") is laid out like the
            parameter (per row: the parameter's shape with the dims a row runs along reduced to 1) and, for a
            DTensor, sharded like it: each rank normalizes its own shard of the update.
        state_dtype: None (the moments, Muon's momentum and AdamW's two, have the parameter's dtype),
            torch.bfloat16 (half the bytes of float32 moments) or "int8" (8-bit codes with a float32 scale per block
            of 256 along the last dim, a quarter of the bytes and 1/64 more: linear codes for Muon's momentum, float8
            e4m3 values for AdamW's moments, the second one's square root; vectors, scalars and tensors split along
            their last dim keep bfloat16). The moments are stepped in float32 and
            stored back with stochastic rounding, so small updates are not lost; the count of rounded writes is
            state "rounding_count". A group's moments follow a change of its state_dtype at its next step.
        offload: None or "cpu": the moments (Muon's momentum, AdamW's two, their block scales, NorMuon's second
            moment) of parameters on a GPU live in pinned host memory; each step streams them to the GPU in groups
            (a bucket of matrices, AdamW tensors of up to 32 MiB of state) on side streams, the next group's fetch
            overlapping this one's update, and writes them back. The GPU then holds about three groups' state.
            DTensor parameters keep DTensor state whose local shards live on the host; the distributed pipeline
            fetches each chunk's while the chunks before it compute (its GPU holds at most four chunks' state). On
            CPU parameters it moves nothing and says so once. Not a per-group option.
        normalize_spatial: in conv_mode "batched", scale each kernel position's update by 1 / sqrt(positions)
            (timm's option; its default is True, ours False: under "match_rms_adamw" both conv modes then give every
            entry AdamW's RMS).
        conv_mode: "flatten" (out, in * k) or "batched" (one (out, in) matrix per kernel position).
        adamw_lr_scale: AdamW's lr is lr * adamw_lr_scale (None: 1), so whatever moves lr moves it too.
        adamw_lr: shorthand for adamw_lr_scale = adamw_lr / lr, with lr as given here (or in the group).
        adamw_betas, adamw_eps: AdamW's (None: betas (0.9, 0.95)).
        adamw_weight_decay: AdamW's decoupled weight decay; None uses weight_decay.
        comm_dtype: dtype of the momentum and of the orthogonalized update while they travel between ranks
            (DTensor parameters, or any parameter with a process_group); torch.float32 sends them unrounded.
        chunk_size: matrices per chunk of the distributed pipeline (one chunk's transfers overlap the previous
            chunk's Newton-Schulz); None is twice the number of ranks.
        process_group: for plain (not DTensor) parameters replicated over this group, as under DDP, each rank
            orthogonalizes about 1/world of the matrices and the results are shared; None keeps plain tensors
            single-device. Not a per-group option. DTensor parameters always use their own device mesh.
        qk_clip: QK-clip (MuonClip, Kimi K2) layers, a mapping from a layer key of your choice (an index, a name)
            to a :class:`QKClipLayer` (query and key weights, or their parameter names, and the head layout).
            `step(qk_logits={key: max_logits})` then clips those layers after the update. Not a per-group option.
        qk_clip_threshold: the largest attention logit a head may keep (Kimi's tau, 100 by default).
        betas, fallback_lr_scale: timm's names for adamw_betas and adamw_lr_scale; groups may also say
            ``use_fallback`` (timm's, the opposite of use_muon) and adjust_lr_fn "rms_to_rms" (timm's "spectral").
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]],
                 lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, ns_coefficients: str | list[Coefficients] = "polar_express", eps: float = 1e-7,
                 adjust_lr_fn: str | None = "match_rms_adamw", ns_dtype: torch.dtype | None = None,
                 ns_algorithm: str = "auto", conv_mode: str = "flatten", normalize_spatial: bool = False,
                 adamw_lr: float | None = None, adamw_lr_scale: float | None = None,
                 adamw_betas: tuple[float, float] | None = None, adamw_eps: float = 1e-8,
                 adamw_weight_decay: float | None = None, comm_dtype: torch.dtype = torch.bfloat16,
                 chunk_size: int | None = None, process_group: "torch.distributed.ProcessGroup | None" = None,
                 qk_clip: Mapping[Hashable, QKClipLayer] | None = None,
                 qk_clip_threshold: float = DEFAULT_THRESHOLD, *, preconditioner: str | None = None,
                 normalization: str | None = None, safety_factor: float = 1.0, scale_eps: bool = False,
                 capturable: bool = False, verbose: bool = False, state_dtype: torch.dtype | str | None = None,
                 betas: tuple[float, float] | None = None, fallback_lr_scale: float | None = None,
                 algo: str | None = None, offload: str | None = None) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        ns_coefficients=ns_coefficients, eps=eps, adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype,
                        ns_algorithm=ns_algorithm, conv_mode=conv_mode, normalize_spatial=normalize_spatial,
                        adamw_lr=adamw_lr, adamw_lr_scale=adamw_lr_scale,
                        adamw_betas=adamw_betas, adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay,
                        comm_dtype=comm_dtype, chunk_size=chunk_size, preconditioner=preconditioner,
                        normalization=normalization, safety_factor=safety_factor, scale_eps=scale_eps,
                        capturable=capturable, verbose=verbose, state_dtype=state_dtype, use_muon=None,
                        param_layout="auto")
        defaults = _entered({**defaults, "betas": betas, "algo": algo, "fallback_lr_scale": fallback_lr_scale}, lr)
        _validate_group(defaults)
        # An attribute, not a group option: param_groups go into state dicts, and a process group cannot be saved.
        self.process_group = process_group
        self.qk_clip_threshold = check_threshold(qk_clip_threshold)
        check_choice("offload", offload, OFFLOAD_TARGETS)
        self.offload = offload
        super().__init__(params, defaults)
        self._say_where_offload_applies()
        # Attributes too: they hold parameters, and names resolve only once the groups (and their names) exist.
        self.qk_clip = resolve_layers(qk_clip or {}, self._named_params())
        self._workspace = Workspace()  # CPU steps' scratch memory, kept from step to step; never saved
        self._kept: dict[int, _Kept] = {}  # by id of each group whose options are all immutable; never saved
        self._held: dict[int, _HeldItems] = {}  # by id of each group; never saved
        self._staged_updates = StagedUpdates()  # with offload, each step's schedule and its kept buffers; never saved
        self._checked_gradients: CheckedGradients | None = None  # what clip_grad_norm_ read for the next step

    def __getstate__(self) -> dict[str, Any]:
        # torch saves defaults, state and param_groups; the QK-clip layers and the process group are attributes.
        process_group = None if self.process_group is None else _PROCESS_GROUP_NOT_SAVED
        return {**super().__getstate__(), "qk_clip": self.qk_clip, "qk_clip_threshold": self.qk_clip_threshold,
                "process_group": process_group, "offload": self.offload}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if state.get("process_group") is not None:  # __getstate__'s marker, a new string once unpickled: step's own
            self.process_group = _PROCESS_GROUP_NOT_SAVED
        # torch's adds a `differentiable` flag to the defaults, which is no option of Muon's: groups added later would
        # carry it.
        self.defaults.pop("differentiable", None)
        self.__dict__.setdefault("offload", None)  # a copy from before the option existed
        self._workspace = Workspace()
        self._kept = {}
        self._held = {}
        self._staged_updates = StagedUpdates()
        self._checked_gradients = None
        for group in self.param_groups:  # a copy from before an option existed gets its default
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def _say_where_offload_applies(self) -> None:
        """offload="cpu" moves the state of parameters on an accelerator; it says once when it moves none."""
        params = [param for group in self.param_groups for param in group["params"]]
        if self.offload is None or any(home_device(param, self.offload) != param.device for param in params):
            return
        warnings.warn(f"Muon: offload={self.offload!r} has no effect here: every parameter is on the CPU already",
                      stacklevel=3)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        entered = _entered(param_group, self.defaults["lr"])
        _validate_group({**self.defaults, **entered})
        # The very dict given becomes the group, as in torch: a training loop may hold it and set its lr.
        param_group.clear()
        param_group.update(entered)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_forced_muon(group)
            if group["ns_dtype"] is not None:
                for device in {param.device for param in group["params"] if self._uses_muon(group, param)}:
                    warn_if_slow(group["ns_dtype"], device)
            if group["verbose"]:
                self._log_routing(group)
        except BaseException:  # a warning raised as an error too: a rejected group leaves the optimizer as it was
            self.param_groups.pop()
            raise

    def _log_routing(self, group: dict[str, Any]) -> None:
        """timm's `verbose`: where each parameter of a new group goes, and why (logged at INFO)."""
        for name, param in zip(_param_names(group), group["params"]):
            if is_lazy(param):
                logger.info("parameter %s (not materialized yet, a lazy module's): routed at its first step", name)
                continue
            view = _view(group, param)
            if group["use_muon"] is not None:
                reason = f"use_muon={group['use_muon']} in its group"
            elif view is not None:
                reason = f"{view.batch} matrix(es) of {view.rows}x{view.cols}"
            else:
                reason = "not a matrix Muon trains (fewer than 2 dimensions, a side below 2, or aspect ratio > 128)"
            logger.info("parameter %s %s -> %s: %s", name, tuple(param.shape), "AdamW" if view is None else "Muon",
                        reason)

    def __repr__(self) -> str:
        """torch's listing of the groups, then what ns_dtype=None resolves to on each device, and why."""
        devices = {param.device for group in self.param_groups if group["ns_dtype"] is None
                   for param in group["params"] if self._uses_muon(group, param)}
        choices = [f"ns_dtype=None on {device}: {choice.dtype}, as {choice.reason}"
                   for device in sorted(devices, key=str) for choice in [ns_dtype_choice(device)]]
        listing = super().__repr__()
        return listing[:-1] + "".join(f"{choice}\n" for choice in choices) + listing[-1:]

    def _named_params(self) -> dict[str, Tensor]:
        return {name: param for group in self.param_groups
                for name, param in zip(group.get("param_names") or (), group["params"])}

    def _uses_muon(self, group: dict[str, Any], param: Tensor) -> bool:
        """Whether Muon steps `param` (not yet known of a lazy module's parameter before its first forward)."""
        return not is_lazy(param) and _view(group, param) is not None

    @staticmethod
    def _adamw_lr(group: dict[str, Any]) -> float | Tensor:
        return _learning_rate(group["lr"]) * as_real(group["adamw_lr_scale"])

    def _check_step_inputs(self, group: dict[str, Any], option_keys: tuple[str, ...]
                           ) -> tuple[_Kept | None, tuple[list[MuonTensors], list[AdamWTensors]] | None]:
        """What a step of this group needs, checked before any group creates state or updates a parameter: a group
        value may have been changed since construction, and a gradient may be of a kind Muon refuses. Returns what
        steps keep from the group's options, or None where they keep nothing (`_checked_options`), and the group's
        items held from an earlier step where they still hold (`_HeldItems`, whatever options other than the layout's
        changed; a gradient sparse, or of another dtype or shape than its parameter held, ends the hold)."""
        kept = self._checked_options(group, option_keys)
        # Not while tracing (dynamo up to torch 2.11 cannot trace id() of a dict): a compiled step gathers each time.
        held = None if torch.compiler.is_compiling() else self._held.get(id(group))
        held = None if held is None else held.items_for(group, self.state)
        if held is None:
            self._check_gradients(group)
            self._check_forced_muon(group)
            if not torch.compiler.is_compiling():
                # These read the state, which a compiled step's `_init_group` creates or converts eagerly as dynamo
                # traces: branching on it first, a retrace after the AdamW part's graph break diverged from the
                # first trace (SpeculationLogDivergence) when a parameter took its first gradient after compiling.
                self._check_state_shapes(group)
                self._check_normalization_state(group)
                self._check_spread_params(group)
        return kept, held

    def _checked_step_inputs(self, option_keys: tuple[str, ...]
                             ) -> list[tuple[_Kept | None, tuple[list[MuonTensors], list[AdamWTensors]] | None]]:
        """`_check_step_inputs` of every group. Outside torch.compile, a refusal puts back the groups whose keys
        `_checked_options` re-entered, so that a refused step leaves every group as it was, a later group's refusal
        included (a compiled step re-enters them before it traces them: `_reenter_groups_`)."""
        if torch.compiler.is_compiling():
            if any(map(_needs_reentry, self.param_groups)):
                self._reenter_groups_()
            return [self._check_step_inputs(group, option_keys) for group in self.param_groups]
        self._groups_before_reentry: list[tuple[dict[str, Any], dict[str, Any]]] = []
        try:
            return [self._check_step_inputs(group, option_keys) for group in self.param_groups]
        except Exception:
            _put_back_(self._groups_before_reentry)
            raise

    @staticmethod
    def _check_gradients(group: dict[str, Any]) -> None:
        """Gradients Muon can take: dense, real, of their floating-point parameter's shape and dtype (as autograd
        makes them; one put in through `.data` or set by hand could be neither, and would be refused only by an update
        part way through the step)."""
        for param in group["params"]:
            grad = param.grad
            if grad is None or not (grad.is_sparse or grad.is_complex() or not param.is_floating_point()
                                    or grad.dtype != param.dtype or grad.shape != param.shape):
                continue
            if grad.is_sparse:
                raise RuntimeError(f"Muon does not support sparse gradients (parameter of shape {tuple(param.shape)})")
            if grad.is_complex() or param.is_complex():
                raise RuntimeError(f"Muon does not support complex parameters (shape {tuple(param.shape)})")
            if not param.is_floating_point():
                raise RuntimeError(f"Invalid parameter: a {param.dtype} parameter of shape {tuple(param.shape)} has a "
                                   "gradient (expected a floating-point parameter)")
            raise RuntimeError(f"Invalid gradient: a {grad.dtype} gradient of shape {tuple(grad.shape)} for the "
                               f"{param.dtype} parameter of shape {tuple(param.shape)} (expected its shape and dtype)")

    def _check_state_shapes(self, group: dict[str, Any]) -> None:
        """State that fits each parameter that steps: one resized in place (`param.data = ...`) since its state was
        made would have its update refused by a kernel part way through the step."""
        for name, param in zip(_param_names(group), group["params"]):
            state = self.state.get(param)
            misshapen = None if not state or param.grad is None else _misshapen_state(state, param.shape)
            if misshapen is not None:
                key, found, expected = misshapen
                raise RuntimeError(f"Invalid state: {key!r} of parameter {name} is {found}, expected {expected} for "
                                   f"the parameter's shape {tuple(param.shape)} (resized since its state was made? "
                                   "`del optimizer.state[param]` restarts it, or load a state of its new shape)")

    def _check_spread_params(self, group: dict[str, Any]) -> None:
        """DTensor parameters a distributed update can spread (`check_spread_param`): it runs group by group and
        chunk by chunk, so what it refuses part way through is asked of every parameter first."""
        for param in group["params"]:
            if param.grad is not None and is_dtensor(param) and self._uses_muon(group, param):
                check_spread_param(param)

    @staticmethod
    def _check_forced_muon(group: dict[str, Any]) -> None:
        """A group that forces its parameters into Muon (`use_muon=True`, also when set since they were added) holds
        only matrices or stacks of them."""
        if group["use_muon"] is not True:
            return
        for name, param in zip(_param_names(group), group["params"]):
            if not is_lazy(param):  # checked at the step that finds it materialized
                check_forced_muon(name, param.shape)

    @torch.compiler.disable
    def _reenter_groups_(self) -> None:
        """A compiled step's re-entry of the groups that need it, run eagerly (a graph break, so a `fullgraph=True`
        step refuses such a group) and put back if any group refuses its options, as an eager step's: traced, the
        write into a group made dynamo write back every key it traced, its own `capturable=True` included."""
        before = [(group, dict(group)) for group in self.param_groups if _needs_reentry(group)]
        try:
            for group, _ in before:
                _reenter_(group)
            for group in self.param_groups:
                _validate_group(group, at_step=True)
        except Exception:
            _put_back_(before)
            raise

    def _checked_options(self, group: dict[str, Any], option_keys: tuple[str, ...]) -> _Kept | None:
        """The group's options checked (`_validate_group`), unless they are the very objects the last step checked;
        what steps keep from them, or None where an option may change in place (a list, a tensor lr) or a
        torch.compile trace runs (whose guards watch the options)."""
        if torch.compiler.is_compiling():
            _validate_group(group, at_step=True)
            return None
        options = operator.itemgetter(*option_keys)(group)  # a third of a generator's time: once per group a step
        kept = self._kept.get(id(group))
        if kept is not None and kept.holds(group, options):
            return kept
        if _needs_reentry(group):
            self._groups_before_reentry.append((group, dict(group)))
            _reenter_(group)
            options = operator.itemgetter(*option_keys)(group)
        _validate_group(group, at_step=True)
        return _Kept(options, len(group)) if all(map(_immutable, options)) else None

    def _graph_capture_health_check(self) -> None:
        """torch's check that a captured step has capturable=True in every group, under its current name: the older
        `_cuda_graph_capture_health_check` warns when called, which a compiled step cannot trace."""
        # Asked of the class, whose answer a compiler folds (torch 2.11's cannot branch on a bound method's truth).
        if hasattr(Optimizer, "_accelerator_graph_capture_health_check"):
            self._accelerator_graph_capture_health_check()
        else:
            self._cuda_graph_capture_health_check()

    def _check_normalization_state(self, group: dict[str, Any]) -> None:
        """A second moment kept from an earlier run must have the shape this group's normalization needs (it changes
        between "neuron" and "element")."""
        if group["normalization"] is None:
            return
        for param in group["params"]:
            view = None if param.grad is None else _view(group, param)
            if view is None:
                continue
            saved = self.state.get(param, {}).get("update_sq")  # never made here: a refused step makes no state
            expected = second_moment_shape(param.shape, view, group["normalization"])
            if saved is not None and tuple(saved.shape) != expected:
                raise ValueError(f"Invalid normalization: {group['normalization']!r} needs a second moment of shape "
                                 f"{expected} for the parameter of shape {tuple(param.shape)}, but its state holds "
                                 f"{tuple(saved.shape)} (from another normalization: delete state['update_sq'] and "
                                 "state['update_step'] to start it afresh)")

    def _init_group(self, group: dict[str, Any], state_tensors: list[Tensor | None]) -> None:
        """The state of the group's parameters with gradients, made ready for this step (`_prepared_state`), and
        listed in `state_tensors` (`_MUON_STATE`, `_ADAMW_STATE`) for `_gather`. The name is torch's optimizers' own:
        torch.compile runs a method so named eagerly while it traces `step`, takes the state it leaves as fixed
        addresses, and the tensors it appends to a list argument as the graph's inputs; the state dict itself the
        tracer keeps as the first group's call left it, so a step of several groups reads its state from the lists
        (read from the dict, the first step of two groups under fullgraph=True raised a KeyError). A CUDA graph of the
        step then updates that state in place; created inside the graph instead, it would be among the graph's
        outputs, which the next replay overwrites."""
        muon_keys, adamw_keys = _state_keys(group, _MUON_STATE), _state_keys(group, _ADAMW_STATE)
        for param in group["params"]:
            if param.grad is not None:
                view = _view(group, param)
                state = self._prepared_state(group, param, view)
                state_tensors.extend(map(state.get, _param_state_keys(muon_keys if view is not None else adamw_keys,
                                                                      state)))

    def _gather(self, group: dict[str, Any], state_tensors: list[Tensor | None],
                hold: bool) -> tuple[list[MuonTensors], list[AdamWTensors]]:
        """The group's parameters with gradients, with their state as `_init_group` listed it; with `hold`, held for
        the next steps (`_HeldItems`). With offload too: state is moved home (`keep_at_home`) only where it was made
        or loaded, as a new tensor, which ends the hold, and packing it at home (`offload.repack_homes`) keeps each
        tensor the same object."""
        muon_items: list[MuonTensors] = []
        adamw_items: list[AdamWTensors] = []
        entries: list[tuple[Tensor, torch.dtype, torch.Size, dict[str, Any] | None, tuple[str | None, ...],
                            tuple[Tensor | None, ...], MuonTensors | AdamWTensors | None]] = []
        # Not asked while torch.compile traces (`hold` False): dynamo warns at every cached function it traces.
        muon_keys, adamw_keys = ((_state_keys(group, _MUON_STATE), _state_keys(group, _ADAMW_STATE)) if hold
                                 else ((), ()))
        start = 0
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                entries.append((param, param.dtype, param.shape, None, (), (), None))
                continue
            view = _view(group, param)
            param_state = self.state[param] if hold else None
            if view is not None:
                keys, count = _param_state_keys(muon_keys, param_state), len(_MUON_STATE)
                momentum, skips, rounding_count, scales, second_moment, update_step = values = tuple(
                    state_tensors[start:start + count])
                item = MuonTensors(param, grad, momentum, skips, view, second_moment, update_step, rounding_count,
                                   scales)
                muon_items.append(item)
            else:
                keys, count = _param_state_keys(adamw_keys, param_state), len(_ADAMW_STATE)
                exp_avg, exp_avg_sq, step, skips, rounding_count, exp_avg_scales, exp_avg_sq_scales = values = tuple(
                    state_tensors[start:start + count])
                item = AdamWTensors(param, grad, exp_avg, exp_avg_sq, step, skips, rounding_count, exp_avg_scales,
                                    exp_avg_sq_scales)
                adamw_items.append(item)
            start += count
            entries.append((param, param.dtype, param.shape, param_state, keys, values, item))
        if hold:
            self._held[id(group)] = _HeldItems(group["params"], tuple(map(group.get, _LAYOUT_OPTIONS)), self.state,
                                               entries, muon_items, adamw_items)
        return muon_items, adamw_items

    def _prepared_state(self, group: dict[str, Any], param: Tensor, view: MatrixView | None) -> dict[str, Any]:
        """A parameter's state as this step needs it (`view`: its matrix view if Muon steps it, None for AdamW): created
        where missing, its moments in the group's state_dtype, and with offload, the moments in pinned host memory
        (where they are created or loaded, on its device). Returns it."""
        state = self.state[param]
        if "nonfinite_skips" not in state:
            state["nonfinite_skips"] = torch.zeros((), dtype=torch.int64, device=param.device)
        rounding_count = None
        if rounds_stochastically(group["state_dtype"]):
            if "rounding_count" not in state:
                state["rounding_count"] = torch.zeros((), dtype=torch.int64, device=param.device)
            rounding_count = state["rounding_count"]
        form = _moment_form(param, group["state_dtype"])
        if view is not None:
            _keep_moments(state, param, _MUON_MOMENTS, form, rounding_count)
            if group["normalization"] is not None and "update_sq" not in state:
                state["update_sq"] = zeros_like_resized(
                    param, second_moment_shape(param.shape, view, group["normalization"]), moment_dtype(param.dtype))
                state["update_step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            elif "update_sq" in state and state["update_sq"].dtype != moment_dtype(param.dtype):
                # The parameter's dtype changed in place (model.double()), as a checkpoint would load it.
                state["update_sq"] = state["update_sq"].to(moment_dtype(param.dtype))
        else:
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            _keep_moments(state, param, _ADAMW_MOMENTS, form, rounding_count)
        if self.offload is not None:
            keep_at_home(state, home_device(param, self.offload))
        return state

    def _muon_steps(self, parts: list[tuple[dict[str, Any], list[MuonTensors]]],
                    schedule: StagedUpdates | None) -> None:
        """Each group's Muon update (`_muon_step`), groups that share buckets in one call of each update; offloaded
        buckets go to `schedule`."""
        pending: _Pending = {}
        for group, items in parts:
            self._muon_step(group, items, pending, schedule)
        _run_pending(pending)

    def _muon_step(self, group: dict[str, Any], items: list[MuonTensors], pending: _Pending,
                   schedule: StagedUpdates | None) -> None:
        """One group's Muon update, added to `pending` (an update and the groups' settings and items it takes): its
        parameters spread over ranks for `distributed_muon_update`, its local ones for `staged_muon_update`, each
        under a key equal for groups whose updates differ only in lr and weight decay (layer-wise lr decay: a group
        per block), so that their same-shape matrices share buckets, and spread over ranks, the owners' plan and
        its collectives. GPT-2 small's structure at 1/96 width with a group per block took 1.76x torch.optim.Muon's
        step time a group at a time (2-core Xeon). Some groups go alone (`_shares_updates`)."""
        if not items:
            return
        settings = self._muon_settings(group, items[0].param.device)
        spread: list[MuonTensors] = []
        local: list[MuonTensors] = []
        for item in items:
            (spread if is_spread(item.param, self.process_group) else local).append(item)
        if spread:
            self._pend(pending, distributed_muon_update, spread, process_group=self.process_group,
                       comm_dtype=group["comm_dtype"], chunk_size=as_integer(group["chunk_size"]), schedule=schedule,
                       **settings)
        if local:
            self._pend(pending, staged_muon_update, local, workspace=self._workspace, schedule=schedule, **settings)

    def _muon_settings(self, group: dict[str, Any], device: torch.device) -> dict[str, Any]:
        """`_muon_settings` of the group, kept with its options where they are (`_Kept`)."""
        kept = None if torch.compiler.is_compiling() else self._kept.get(id(group))
        if kept is None:
            return _muon_settings(group, device)
        settings = kept.muon_settings.get(device)
        if settings is None:
            settings = kept.muon_settings[device] = _muon_settings(group, device)
        return settings

    def _pend(self, pending: _Pending, update: Callable[..., None], items: list[MuonTensors] | list[AdamWTensors],
              **settings: Any) -> None:
        """`items` for `update` with `settings`, with the items of other groups whose settings differ only in the
        rates, or alone: under a key no other takes (the count of keys so far; dynamo up to torch 2.11 cannot trace
        `id` of a list, which failed every compiled step with a tensor lr on an H100)."""
        key = (update, *_shared_update_key(settings)) if self._shares_updates(settings) else (len(pending),)
        pending.setdefault(key, (update, []))[1].append((settings, items))

    def _shares_updates(self, settings: dict[str, Any]) -> bool:
        """Whether a group's parameters may share update calls with other groups': not with a tensor lr (kept a
        tensor to the update), nor while a CUDA graph is captured from an eager step, whose replays would read the
        per-item decay factors from host memory freed after the capture (`functional._on_device`; a compiled step
        holds them as constants)."""
        if isinstance(settings["lr"], Tensor):
            return False
        # is_compiling first: the tracer folds it to True and reads nothing after it.
        return torch.compiler.is_compiling() or not (torch.cuda.is_available()
                                                     and torch.cuda.is_current_stream_capturing())

    # torch's fused AdamW kernel cannot go into a compiled graph (inductor cannot lower it; torch keeps it out of its
    # own): the whole AdamW part runs eagerly, one break per step, outside any loop a compiled step must keep.
    @torch.compiler.disable
    def _adamw_steps(self, groups: list[tuple[dict[str, Any], list[AdamWTensors]]],
                     schedule: StagedUpdates | None) -> None:
        """Each group's AdamW update (`_adamw_step`), groups that differ only in lr and weight decay in one update:
        GPT-2 small's structure at 1/384 width with a param group per block took 2.10-2.17 ms a step with an update
        per group, 2.00-2.04 shared (2-core Xeon); on a GPU each update is three Triton launches. Offloaded groups
        of parameters go to `schedule`."""
        try:
            pending: _Pending = {}
            for group, items in groups:
                self._adamw_step(group, items, pending, schedule)
            _run_pending(pending)
        finally:
            self._checked_gradients = None  # one step's worth: the next clip checks afresh

    def _adamw_step(self, group: dict[str, Any], items: list[AdamWTensors], pending: _Pending,
                    schedule: StagedUpdates | None) -> None:
        """One group's AdamW update, added to `pending` as `_muon_step` adds its Muon update."""
        weight_decay = group["adamw_weight_decay"]
        self._pend(pending, self._adamw_update, items, schedule=schedule, lr=self._adamw_lr(group),
                   betas=tuple(map(as_real, group["adamw_betas"])), eps=as_real(group["adamw_eps"]),
                   weight_decay=as_real(group["weight_decay"] if weight_decay is None else weight_decay))

    def _adamw_update(self, items: list[AdamWTensors], *, schedule: StagedUpdates | None, **settings: Any) -> None:
        """The AdamW update of items whose `lr` and `weight_decay` are one for all or one per item."""
        rates = Rates(items, settings["lr"], settings["weight_decay"])
        for device_items in by_device(items).values():
            device_settings = rates.settings_for(device_items, settings)  # by the items, before shards replace them
            # Whether each gradient is finite, on every rank for a DTensor: a question for the distributed layer,
            # unless clip_grad_norm_ found out while it read them; plain gradients are checked by the update itself.
            # The update is elementwise: each rank runs it on its own shards, as plain tensors.
            checked = self._checked_gradients
            grads = [item.grad for item in device_items]
            spread = any_dtensor(grads)
            found_inf = None if checked is None else checked.found_inf([item.param for item in device_items])
            if found_inf is None and spread:
                found_inf = found_inf_flags(grads)
            if spread:
                device_items = [_local_adamw_item(item) for item in device_items]
            staged_adamw_update(device_items, found_inf, schedule=schedule, **device_settings)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None,
             qk_logits: Mapping[Hashable, Tensor] | None = None) -> float | None:  # type: ignore[override]
        """One optimization step. `closure` re-evaluates the model and returns the loss.

        `qk_logits` (with `qk_clip` configured): layer key -> the largest attention logit of each query head seen in
        this step's forward pass, shape (num_heads,), as compared with the threshold (Kimi includes the softmax
        scale 1/sqrt(head_dim)). After the update, heads above `qk_clip_threshold` get their query and key rows
        scaled down so their logits would fall to it; see `qk_clip.py`. Under data parallelism the logits are
        reduced with MAX over the ranks first, so every rank must pass the same keys.
        """
        if self.process_group is _PROCESS_GROUP_NOT_SAVED:
            raise RuntimeError("Invalid process_group: this optimizer was copied or unpickled, and a process group "
                               "cannot be saved; set `optimizer.process_group = <the group>` (or None) before step()")
        self._graph_capture_health_check()
        qk_logits = {} if qk_logits is None else qk_logits
        check_qk_logits(self.qk_clip, qk_logits)  # before any update: bad input changes nothing
        threshold = check_threshold(self.qk_clip_threshold) if qk_logits else None  # an attribute, settable
        loss = None
        if closure is not None:  # under the caller's autocast, as torch's optimizers run it
            with torch.enable_grad():
                loss = closure()
        self._update(qk_logits, threshold)
        return loss

    @without_autocast
    def _update(self, qk_logits: Mapping[Hashable, Tensor], threshold: float | None) -> None:
        """The step's update of every group, and the QK-clip after it."""
        option_keys = tuple(self.defaults)
        kept, held = zip(*self._checked_step_inputs(option_keys))
        # Not while tracing: dynamo in torch 2.11 cannot set an attribute of the optimizer (2.13's can), nor trace id()
        # of a dict. Kept entries stay valid across compiled steps: each holds only while its options are the same.
        if not torch.compiler.is_compiling():
            self._kept = {id(group): each for group, each in zip(self.param_groups, kept) if each is not None}
        state_tensors: list[list[Tensor | None]] = [[] for _ in self.param_groups]
        for group, tensors, items in zip(self.param_groups, state_tensors, held):
            if items is None:
                self._init_group(group, tensors)
        hold = not torch.compiler.is_compiling()
        gathered = [self._gather(group, tensors, hold) if items is None else items
                    for group, tensors, items in zip(self.param_groups, state_tensors, held)]
        # Offloaded updates run once both parts have issued theirs, so that all their state streams in one schedule.
        schedule = self._staged_updates if self.offload is not None else None
        self._muon_steps([(group, muon_items) for group, (muon_items, _) in zip(self.param_groups, gathered)], schedule)
        adamw_groups = [(group, adamw_items) for group, (_, adamw_items) in zip(self.param_groups, gathered)
                        if adamw_items]
        if adamw_groups:
            self._adamw_steps(adamw_groups, schedule)
        if schedule is not None:
            schedule.run()
        if qk_logits:
            clip_checked_(self.qk_clip, qk_logits, threshold, self.process_group)
        if hold:  # and the held items of groups no longer in the optimizer go
            self._held = {id(group): self._held[id(group)] for group in self.param_groups if id(group) in self._held}
            for each in self._held.values():
                each.release_gradients()
                if each.addresses is None:
                    each.note_addresses()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> Tensor:
        """`torch.nn.utils.clip_grad_norm_` over this optimizer's parameters: scales their gradients in place so
        that their total norm is at most `max_norm` (`math.inf`: only measure it), and returns the total norm.

        Plain tensors on one device are read once each, for their norm and for whether they are finite, and the
        next `step()` takes those flags for its AdamW-routed parameters instead of reading their gradients again; a
        gradient replaced or changed in place since is read again. For the L2 norm on the CPU (with the compiled
        ops) the total is accumulated in float64 (float32 result, float64 for float64 gradients); elsewhere it is
        torch's, from torch's per-gradient norms (`clipping.clip_by_tensor_norms_`). DTensor gradients, gradients on
        several devices and, where the compiled ops do not serve, `foreach=False` go to torch's function."""
        max_norm = check_max_norm(max_norm)
        params = [param for group in self.param_groups for param in group["params"] if param.grad is not None]
        grads = [param.grad for param in params]
        self._checked_gradients = None
        if reads_once(grads, norm_type):
            total, nonfinite = clip_grad_norm_(grads, max_norm, error_if_nonfinite)
        elif foreach is not False and tensor_norms_serve(grads):
            total, nonfinite = clip_by_tensor_norms_(grads, max_norm, float(norm_type), error_if_nonfinite)
        else:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        self._checked_gradients = CheckedGradients(params, nonfinite)
        return total

    def nonfinite_skips(self) -> int:
        """How many parameter updates were skipped because a gradient had a NaN or Inf (syncs with the device)."""
        return int(sum(int(state["nonfinite_skips"]) for state in self.state.values() if "nonfinite_skips" in state))

    @contextlib.contextmanager
    def _hooks_held(self, *attributes: str) -> Iterator[tuple[OrderedDict, ...]]:
        """Torch's hooks of these kinds kept from running inside torch's method, which we wrap to run them ourselves
        where they belong; yields them. Put back as the same dict objects, so their removal handles still work."""
        held = tuple(getattr(self, attribute) for attribute in attributes)
        for attribute in attributes:
            setattr(self, attribute, OrderedDict())
        try:
            yield held
        finally:
            for attribute, hooks in zip(attributes, held):
                setattr(self, attribute, hooks)

    def state_dict(self) -> dict[str, Any]:
        # torch's, with the dtype options by name (`_DTYPE_OPTIONS`) before the post-hooks see it, so that a hook sees
        # what a checkpoint will hold.
        with self._hooks_held("_optimizer_state_dict_post_hooks") as (post_hooks,):
            state_dict = super().state_dict()
        state_dict = {**state_dict, "param_groups": list(map(_dtypes_named, state_dict["param_groups"]))}
        for hook in post_hooks.values():
            adapted = hook(self, state_dict)
            if adapted is not None:
                state_dict = adapted
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The load pre-hooks run first, as in torch, so that a hook can adapt a checkpoint (rename parameters,
        # reshape state) before the matching and checks below see it; torch's own pass over them is then skipped.
        state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            adapted = hook(self, state_dict)
            if adapted is not None:
                state_dict = adapted
        _check_group_sizes(state_dict["param_groups"], self.param_groups)
        # A checkpoint from before an option existed lacks its key: the option's default applies, as torch
        # optimizers' __setstate__ does. A saved group enters as a group given those keys between steps would at the
        # next step. Every loaded group is checked before anything is loaded.
        state_dict = {**state_dict, "param_groups": [_reentered(_dtypes_from_names(saved), self.defaults["lr"])
                                                     for saved in state_dict["param_groups"]]}
        state_dict = _aligned_by_name(state_dict, self.param_groups)
        state_dict = {**state_dict, "state": {saved_id: _codes_under_their_keys(saved)
                                              for saved_id, saved in state_dict["state"].items()}}
        state_dict = {**state_dict, "param_groups": [{**self.defaults, **saved}
                                                     for saved in state_dict["param_groups"]]}
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            _validate_group(saved)
            self._check_forced_muon({**saved, "params": group["params"]})
        _check_saved_state(state_dict, self.param_groups)
        # The post-hooks run last, as in torch, on the state as loaded here (torch's pass casts what
        # `_restore_state_dtypes` restores; a hook's change made before it was overwritten). Out of inference mode:
        # state made under it would be inference tensors, which no later step could update.
        with self._hooks_held("_optimizer_load_state_dict_pre_hooks",
                              "_optimizer_load_state_dict_post_hooks") as (_, post_hooks), torch.inference_mode(False):
            super().load_state_dict(state_dict)
            self._restore_state_dtypes(state_dict)
        for hook in post_hooks.values():
            hook(self)

    def _restore_state_dtypes(self, state_dict: dict[str, Any]) -> None:
        """The loaded state in the dtypes it keeps, where torch's load cast it to the parameter's."""
        saved_ids = chain.from_iterable(group["params"] for group in state_dict["param_groups"])
        params = chain.from_iterable(group["params"] for group in self.param_groups)
        for saved_id, param in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id, {})
            exact_dtypes = {key: dtype_for(param.dtype) for key, dtype_for in _EXACT_STATE_DTYPES.items()}
            # Moments and their scales load as they were saved (torch would cast them to the parameter's dtype); a
            # step converts them if the group now stores them in another form.
            exact_dtypes.update({key: saved[key].dtype for key in saved if key in _MOMENT_STATE_KEYS})
            for key, dtype in exact_dtypes.items():
                if key in saved:
                    self.state[param][key] = saved[key].to(dtype=dtype, device=param.device).clone(
                        memory_format=torch.contiguous_format)
