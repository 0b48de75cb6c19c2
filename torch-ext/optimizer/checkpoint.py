"""What `Muon.load_state_dict` makes of a saved state dict before torch loads it (dtype options by name, saved
groups paired by parameter name, 8-bit codes under their own keys), the checks it passes first, and the state dtypes
restored after torch's load cast them."""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.nn.parameter import is_lazy

from .state_layout import (ADAMW_MOMENTS, MOMENT_STATE_KEYS, MUON_MOMENTS, OWN_DTYPES, misplaced_state,
                           misshapen_state)
from .state_precision import CODES_KEYS, MOMENT_KEYS, codes_key

# State created together, so saved together: lazy initialisation keys on one of each (AdamW's "step", a
# normalization's "update_sq"), and without the others the next step would restart them or fail part way.
_SAVED_TOGETHER = ((("step", "exp_avg", "exp_avg_sq"), "AdamW state"),
                   (("update_sq", "update_step"), "a second moment's state"))


# Options whose values may be torch dtypes, which a state dict holds by name ("torch.bfloat16"): DCP's full state dict
# (`StateDictOptions(full_state_dict=True)`, as Accelerate saves FSDP2 models) takes only tensors, numbers, strings,
# lists, dicts and None, and refused every Muon state dict ("Unexpected value type <class 'torch.dtype'>").
_DTYPE_OPTIONS = ("ns_dtype", "comm_dtype", "state_dtype")


def dtypes_named(group: dict[str, Any]) -> dict[str, Any]:
    return {key: str(value) if key in _DTYPE_OPTIONS and isinstance(value, torch.dtype) else value
            for key, value in group.items()}


def dtypes_from_names(group: dict[str, Any]) -> dict[str, Any]:
    """A saved group with the dtypes `dtypes_named` named as dtypes again (state_dtype's "int8" is no dtype's name)."""
    return {key: _named_dtype(key, value)
            if key in _DTYPE_OPTIONS and isinstance(value, str) and value.startswith("torch.") else value
            for key, value in group.items()}


def _named_dtype(key: str, name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Invalid {key}: {name!r} names no torch dtype")
    return dtype


def check_group_sizes(saved_groups: list[dict[str, Any]], param_groups: list[dict[str, Any]]) -> None:
    """torch's checks of the groups' number and sizes, with torch's messages, before the checks that pair the saved
    groups and parameters with these (their errors would name a state mismatch instead)."""
    if len(saved_groups) != len(param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(saved["params"]) != len(group["params"]) for saved, group in zip(saved_groups, param_groups)):
        raise ValueError("loaded state dict contains a parameter group that doesn't match the size of optimizer's "
                         "group")


def check_saved_state(state_dict: dict[str, Any], param_groups: list[dict[str, Any]]) -> None:
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
        misshapen = None if not saved else misshapen_state(saved, param.shape)
        if misshapen is not None:
            key, found, expected = misshapen
            raise ValueError(f"Invalid state_dict: state {key!r} of parameter {saved_id!r} is {found}, expected a "
                             f"tensor of shape {expected} (the parameter it loads into has shape "
                             f"{tuple(param.shape)})")
        misplaced = None if not saved else misplaced_state(saved, param)
        if misplaced is not None:
            key, found, expected = misplaced
            raise ValueError(f"Invalid state_dict: state {key!r} of parameter {saved_id!r} is {found}, expected "
                             f"{expected}, as the parameter it loads into is laid out (state saved under another "
                             "layout loads through torch.distributed.checkpoint, which reshards it)")


def _check_saved_moments(saved_id: Any, saved: dict[str, Any]) -> None:
    """A parameter's saved state holds its moments (state without them would restart them from zero), each a float
    tensor under its key, or 8-bit codes (int8) under theirs with their block scales beside them (codes read without
    their scales would be taken as values, and values with scales as codes)."""
    where = f"Invalid state_dict: parameter {saved_id!r} has"
    if saved and not any(key in saved for key in (*MOMENT_KEYS, *CODES_KEYS)):
        raise ValueError(f"{where} state {sorted(saved)} without its moments (one of {', '.join(MOMENT_KEYS)}, or "
                         f"their 8-bit codes {', '.join(CODES_KEYS)})")
    for key, codes_key_, scales_key in (*MUON_MOMENTS, *ADAMW_MOMENTS):
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


def codes_under_their_keys(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved parameter's state with 8-bit codes found under their moment's own key (where versions before
    2026-11-27 kept them) moved to theirs."""
    moved = {key: codes_key(key) for key in MOMENT_KEYS
             if isinstance(saved.get(key), Tensor) and saved[key].dtype == torch.int8 and codes_key(key) not in saved}
    return {moved.get(key, key): value for key, value in saved.items()} if moved else saved


def aligned_by_name(state_dict: dict[str, Any], param_groups: list[dict[str, Any]]) -> dict[str, Any]:
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


def restore_state_dtypes_(state: Mapping[Tensor, dict[str, Any]], state_dict: dict[str, Any],
                          param_groups: list[dict[str, Any]]) -> None:
    """The state torch's load made of `state_dict` in the dtypes it keeps, where torch cast it to the parameter's."""
    saved_ids = chain.from_iterable(group["params"] for group in state_dict["param_groups"])
    params = chain.from_iterable(group["params"] for group in param_groups)
    for saved_id, param in zip(saved_ids, params):
        saved = state_dict["state"].get(saved_id, {})
        exact_dtypes = {key: dtype_for(param.dtype) for key, dtype_for in OWN_DTYPES.items()}
        # Moments and their scales load as they were saved (torch would cast them to the parameter's dtype); a
        # step converts them if the group now stores them in another form.
        exact_dtypes.update({key: saved[key].dtype for key in saved if key in MOMENT_STATE_KEYS})
        for key, dtype in exact_dtypes.items():
            if key in saved:
                state[param][key] = saved[key].to(dtype=dtype, device=param.device).clone(
                    memory_format=torch.contiguous_format)
