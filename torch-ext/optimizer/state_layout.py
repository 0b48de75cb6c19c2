"""Each parameter's state: the keys a step lists it under, the form its moments are stored in (the group's
state_dtype), created or converted to that form, and the shapes a parameter's state must have."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from .distributed.dtensors import (laid_out_as, layout_name, local_or_none, local_tensor, splits_last_dim,
                                  state_layout_name, zeros_like_resized)
from .distributed.layout import shard_positions
from .normalization import moment_dtype
from .state_precision import (CODES_KEYS, MOMENT_KEYS, codes_key, is_quantized, rounds_stochastically, scale_key,
                              scales_shape, store_, stored_dtype, working_copy)

# Per-element state has the parameter's shape; counters are scalars. Anything else would make the fused kernels read
# and write outside the parameter's memory, so a checkpoint that disagrees is refused before it is loaded.
_SCALAR_STATE_KEYS = ("step", "update_step", "nonfinite_skips", "rounding_count")
_SCALE_STATE_KEYS = tuple(scale_key(key) for key in MOMENT_KEYS)
_MOMENTUM_SCALES, _EXP_AVG_SCALES, _EXP_AVG_SQ_SCALES = _SCALE_STATE_KEYS  # in MOMENT_KEYS' order
_MOMENTUM_CODES, _EXP_AVG_CODES, _EXP_AVG_SQ_CODES = CODES_KEYS
MOMENT_STATE_KEYS = (*MOMENT_KEYS, *CODES_KEYS, *_SCALE_STATE_KEYS)
_PER_ELEMENT_KEYS = (*MOMENT_STATE_KEYS, "update_sq")
# Each part's moments, each with the keys of its 8-bit codes and their scales (formed once: a step asks for them per
# parameter).
MUON_MOMENTS = (("momentum_buffer", _MOMENTUM_CODES, _MOMENTUM_SCALES),)
ADAMW_MOMENTS = (("exp_avg", _EXP_AVG_CODES, _EXP_AVG_SCALES), ("exp_avg_sq", _EXP_AVG_SQ_CODES, _EXP_AVG_SQ_SCALES))


# The dtype each counter and the second moment keep, whatever their parameter's: torch's load casts floating state to
# the parameter's dtype (a bf16 step count stops at 256), a parameter's dtype changes in place (`model.double()`), and a
# count set by hand (`state["step"] = torch.tensor(0)`, int64) failed the update part way through a step.
OWN_DTYPES: dict[str, Callable[[torch.dtype], torch.dtype]] = {
    "step": lambda _: torch.float32, "update_step": lambda _: torch.float32, "update_sq": moment_dtype,
    "nonfinite_skips": lambda _: torch.int64, "rounding_count": lambda _: torch.int64}


def keep_own_dtypes(state: dict[str, Any], param_dtype: torch.dtype) -> None:
    """The counters and second moment `state` holds, in their `OWN_DTYPES`."""
    for key, dtype_for in OWN_DTYPES.items():
        value = state.get(key)
        dtype = dtype_for(param_dtype)
        if value is not None and value.dtype != dtype:
            state[key] = value.to(dtype)


# The state a step's items take, in the order `Muon._init_group` lists it and `Muon._gather` reads it.
MUON_STATE = ("momentum_buffer", "nonfinite_skips", "rounding_count", _MOMENTUM_SCALES, "update_sq", "update_step")
ADAMW_STATE = ("exp_avg", "exp_avg_sq", "step", "nonfinite_skips", "rounding_count", _EXP_AVG_SCALES,
               _EXP_AVG_SQ_SCALES)


def state_keys(group: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, ...]:
    """`keys` with None for the state this group's options do not use: a rounding count kept from an earlier
    state_dtype, a second moment from an earlier normalization. (No state has a None key: its tensor is None.)"""
    return _used_state_keys(group["state_dtype"], group["normalization"], keys)


@functools.cache  # asked twice per group and step (`Muon._init_group`, which runs eagerly under torch.compile too)
def _used_state_keys(state_dtype: torch.dtype | str | None, normalization: str | None,
                     keys: tuple[str, ...]) -> tuple[str | None, ...]:
    unused = set()
    if not rounds_stochastically(state_dtype):
        unused.add("rounding_count")
    if normalization is None:
        unused.update(("update_sq", "update_step"))
    return tuple(None if key in unused else key for key in keys)


def param_state_keys(keys: tuple[str | None, ...], state: Mapping[str, Any] | None) -> tuple[str | None, ...]:
    """The keys a step lists a parameter's state under (`keys`: its part's, `state_keys`): its moments' 8-bit codes'
    where it keeps codes (a part's moments are in one form; its first moment's key comes first)."""
    return _keys_with_codes(keys) if state is not None and codes_key(keys[0]) in state else keys


@functools.cache
def _keys_with_codes(keys: tuple[str | None, ...]) -> tuple[str | None, ...]:
    return tuple(codes_key(key) if key in MOMENT_KEYS else key for key in keys)


def misshapen_state(state: Mapping[str, Any], shape: torch.Size) -> tuple[str, Any, tuple[int, ...]] | None:
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


def misplaced_state(state: Mapping[str, Any], param: Tensor) -> tuple[str, str, str] | None:
    """The first per-element state entry (of a shape that fits `param`, `misshapen_state`) not laid out as a step
    makes it (`laid_out_as`): its key, its layout and the one expected."""
    for key, value in state.items():
        if key in _PER_ELEMENT_KEYS and isinstance(value, Tensor) and not laid_out_as(value, param):
            return key, layout_name(value), state_layout_name(param, value.shape)
    return None


def moment_form(param: Tensor, state_dtype: torch.dtype | str | None) -> tuple[torch.dtype, bool]:
    """The dtype a parameter's moments are stored in, and whether as 8-bit codes with block scales. "int8" applies to
    tensors of 2 or more dims whose last dim each rank holds whole; vectors, scalars and shards of a split last dim
    keep bfloat16 (a vector's bytes are few, and blocks cut by a shard boundary would not survive a reshard)."""
    if state_dtype is None:  # asked of every parameter every step: the default answered first
        return param.dtype, False
    if is_quantized(state_dtype) and (param.dim() < 2 or splits_last_dim(param)):
        state_dtype = torch.bfloat16
    return stored_dtype(param.dtype, state_dtype), is_quantized(state_dtype)


def keep_moments(state: dict[str, Any], param: Tensor, moments: tuple[tuple[str, str, str], ...],
                 form: tuple[torch.dtype, bool], rounding_count: Tensor | None) -> None:
    """The `moments` (each key with its codes' and scales' keys) in `form` (see `moment_form`): created as zeros, or
    converted from another form (the group's state_dtype was changed, or a checkpoint saved under another one or
    another sharding was loaded)."""
    dtype, quantized = form
    for key, codes, scales_key in moments:
        kept_key = codes if quantized else key
        moment = state.get(kept_key)
        if moment is not None and moment.dtype == dtype:
            if not local_tensor(moment).is_contiguous():  # set by hand in its parameter's layout (channels_last)
                state[kept_key] = moment.contiguous()  # the update ops walk it as contiguous
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
