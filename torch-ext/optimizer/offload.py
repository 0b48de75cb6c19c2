"""`offload="cpu"`: optimizer state kept in pinned host memory and brought to the compute device one group of
parameters at a time, the next group's copy in flight while the current one computes.

`run_staged` is the schedule, written against a `Copier` so that it runs, and is tested, without a GPU:
    fetch(0); fetch(1); update(0); write back(0); fetch(2); update(1); write back(1); ...
The CUDA copier issues the copies on a side stream: a fetch waits for nothing on the compute stream (the host memory it
reads is written back on the same side stream, so in order), an update waits for its fetch's event, and a write-back
waits for the update's event. The device then holds at most two groups' state at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from .state_precision import MOMENT_KEYS, scale_key

OFFLOAD_TARGETS: tuple[str | None, ...] = (None, "cpu")
# The state the option moves: the moments and their block scales, and NorMuon/AdaMuon's second moment. Counters stay
# with the parameter (a few bytes, read by every step's bookkeeping).
OFFLOADED_STATE = (*MOMENT_KEYS, *(scale_key(key) for key in MOMENT_KEYS), "update_sq")
# The same tensors as the fields of functional's MuonTensors and AdamWTensors.
OFFLOADED_FIELDS = ("momentum_buffer", "momentum_scales", "second_moment", "exp_avg", "exp_avg_sq", "exp_avg_scales",
                    "exp_avg_sq_scales")

Item = TypeVar("Item")


def home_device(param: Tensor, offload: str | None) -> torch.device:
    """Where a parameter's offloadable state lives: the host with `offload="cpu"` and a parameter elsewhere."""
    return torch.device("cpu") if offload == "cpu" and param.device.type != "cpu" else param.device


def keep_at_home(state: dict[str, Any], home: torch.device) -> None:
    """Moves a parameter's offloadable state where it lives (after its creation on the parameter's device, or a
    checkpoint load, which torch places there); host copies are pinned, so the transfers run asynchronously."""
    for key in OFFLOADED_STATE:
        if key in state and state[key].device != home:
            moved = state[key].to(home)
            state[key] = moved.pin_memory() if home.type == "cpu" and torch.cuda.is_available() else moved


def offloaded(item: Any) -> bool:
    """Whether any of an item's state tensors lives away from its parameter."""
    return any(getattr(item, field, None) is not None and getattr(item, field).device != item.param.device
               for field in OFFLOADED_FIELDS)


class Copier(Protocol):
    def fetch(self, homes: list[Tensor], device: torch.device) -> Any:
        """Starts copying `homes` to `device`; returns a handle for `ready`."""

    def ready(self, handle: Any) -> list[Tensor]:
        """The device copies of a fetch, safe to use on the compute stream."""

    def write_back(self, copies: list[Tensor], homes: list[Tensor]) -> None:
        """Starts copying the updated `copies` back into `homes` once the compute stream is done with them."""

    def finish(self) -> None:
        """Returns once every write-back is in host memory."""


@dataclass
class _Fetched:
    copies: list[Tensor]
    event: torch.cuda.Event


class CudaCopier:
    """Copies on a side stream of the parameters' GPU, ordered with the compute stream by events."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)

    def fetch(self, homes: list[Tensor], device: torch.device) -> _Fetched:
        with torch.cuda.stream(self.stream):
            copies = [home.to(device, non_blocking=True) for home in homes]
            return _Fetched(copies, self.stream.record_event())

    def ready(self, handle: _Fetched) -> list[Tensor]:
        compute = torch.cuda.current_stream(self.stream.device)
        compute.wait_event(handle.event)
        for copy in handle.copies:  # allocated on the side stream, used on the compute stream
            copy.record_stream(compute)
        return handle.copies

    def write_back(self, copies: list[Tensor], homes: list[Tensor]) -> None:
        self.stream.wait_event(torch.cuda.current_stream(self.stream.device).record_event())
        with torch.cuda.stream(self.stream):
            for copy, home in zip(copies, homes):
                home.copy_(copy, non_blocking=True)

    def finish(self) -> None:
        self.stream.synchronize()  # the host may read the state as soon as step() returns


def run_staged(groups: Sequence[Sequence[Item]], update: Callable[[list[Item]], None], copier: Copier) -> None:
    """update(group) for each group of functional's items with their offloaded state on the parameters' device: the
    next group's state is fetched before this group's update is issued, and this group's is written back after."""
    if not groups:
        return
    pending = _fetch(groups[0], copier)
    for index, group in enumerate(groups):
        staged, homes, handle = pending
        copies = copier.ready(handle)
        if index + 1 < len(groups):
            pending = _fetch(groups[index + 1], copier)
        update(_with_copies(staged, copies))
        copier.write_back(copies, homes)
    copier.finish()


def _fetch(group: Sequence[Item], copier: Copier) -> tuple[list[Item], list[Tensor], Any]:
    """The group, its home tensors in field order, and the fetch of their copies."""
    homes = [getattr(item, field) for item in group for field in _fields(item)]
    return list(group), homes, copier.fetch(homes, group[0].param.device)


def _fields(item: Any) -> list[str]:
    return [field for field in OFFLOADED_FIELDS if getattr(item, field, None) is not None]


def _with_copies(group: list[Item], copies: list[Tensor]) -> list[Item]:
    staged, position = [], 0
    for item in group:
        fields = _fields(item)
        staged.append(replace(item, **dict(zip(fields, copies[position:position + len(fields)]))))
        position += len(fields)
    return staged
