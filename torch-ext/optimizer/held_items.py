"""What a step keeps for the steps after it: a group's checked options (`KeptOptions`) and its gathered items
(`HeldItems`), each valid while what it was derived from stays the very same objects."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from .distributed.dtensors import is_dtensor
from .functional import AdamWTensors, MuonTensors
from .group_options import UNSUPPORTED_FLAGS


# Option values that cannot change in place: a group holding only these keeps what a step derived from it while each
# value stays the very same object (a scheduler that sets `lr` puts a new one there).
_IMMUTABLE_OPTION_TYPES = (bool, int, float, str, type(None), torch.dtype)


def _immutable(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(map(_immutable, value))
    return isinstance(value, _IMMUTABLE_OPTION_TYPES)


@dataclass
class KeptOptions:
    """What steps derive from a group whose options are the very objects `options` holds: that they passed the
    checks, and the Muon update's settings per device. An unchanged group cost ~6 µs a step in checks and ~7 in
    settings (2-core Xeon), a fifth of a millisecond for a model with a param group per block."""

    options: tuple
    size: int  # the group's number of keys: one more is one a group only enters with (`reenter_`)
    muon_settings: dict[torch.device, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, group: dict[str, Any], options: tuple) -> KeptOptions | None:
        """What steps keep of a group whose options just passed the checks, or None where one may change in place (a
        list, a tensor lr)."""
        return cls(options, len(group)) if all(map(_immutable, options)) else None

    def holds(self, group: dict[str, Any], options: tuple) -> bool:
        """Whether the group still has these options and no torch flag Muon refuses switched on (a group loaded
        from a torch optimizer's state dict holds them switched off: not an option, so not in `options`)."""
        return (len(group) == self.size and all(map(operator.is_, options, self.options))
                and not any(map(group.get, UNSUPPORTED_FLAGS)))


# The options that decide how a group's parameters are routed and what state they keep (`muon._view`, `state_keys`,
# `Muon._prepared_state`): held items hold while these stay the same objects, whatever the others do (a scheduler
# sets a new `lr` at every step).
LAYOUT_OPTIONS = ("use_muon", "param_layout", "conv_mode", "state_dtype", "normalization")


@dataclass
class HeldItems:
    """A group's step items as a step gathered them (`Muon._gather`), kept for the steps after: while the group's
    parameters are the same, of the same dtypes (`model.double()` changes them in place), with gradients where they
    had them, of those dtypes and shapes (`.grad.data` can change them), its `LAYOUT_OPTIONS` the same, and each
    parameter's state holds the same tensors under the same keys, a step takes these items with the new gradients
    instead of checking, preparing and gathering each parameter's state again. GPT-2 small's 97 AdamW tensors at
    1/96 width: the check, preparation and gathering took ~320 µs of the AdamW part's ~600 µs of host time, this
    check ~70 (2-core AMD EPYC). A state tensor replaced or given new storage (`.data`, as moving state to the host
    and back does, maybe in another dtype), a parameter's state dropped or loaded, a layout option changed: the step
    gathers afresh, and checks the state (a kernel refused a moment of another shape or dtype part way through)."""

    params: list[Tensor]  # the group's own list
    options: tuple  # the group's LAYOUT_OPTIONS
    state: Mapping[Tensor, dict[str, Any]]  # the optimizer's state mapping
    # Per parameter: itself, its dtype and shape, and with a gradient, its state dict, the keys its item was read from,
    # their values then (`MUON_STATE`, `ADAMW_STATE`, as `state_keys` leaves them) and its item.
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
                or not all(map(operator.is_, map(group.get, LAYOUT_OPTIONS), self.options))
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
