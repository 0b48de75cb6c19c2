"""A stand-in for the CUDA copier of `offload="cpu"`, so that the staging schedules run, and are checked, on a CPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any
from unittest import mock

import torch
from kernel_under_test import optimizer, submodule

offload_module = submodule(optimizer, "offload")


class RecordingCopier:
    """The CUDA copier's interface and copies, synchronous and on the CPU: fetches fill the "device" copies, write-backs
    copy them into the homes, both as the CUDA copier does (packed homes included), so an update that read or wrote the
    homes instead of the copies would leave the homes unstepped. Each write-back's handle is its number in the step;
    `waits` holds, for each fetch, the handle it was told to wait for, and `sides`, for each call that names a
    stream, the call and whether it was told the side stream (`aside`)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.waits: list[Any] = []
        self.sides: list[tuple[str, bool]] = []
        self.written = 0

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def begin(self) -> None:
        self.sides.append(("begin", True))

    def fetch(self, transfer: Any, after: Any = None) -> None:
        self.log.append("fetch")
        self.waits.append(after)
        offload_module.copy_all(transfer.device_side, transfer.host_side)

    def ready(self, handle: None, aside: bool = False) -> None:
        self.log.append("ready")
        self.sides.append(("ready", aside))

    def updating(self, aside: bool = False) -> AbstractContextManager:
        self.sides.append(("updating", aside))
        return nullcontext()

    def write_back(self, transfer: Any, aside: bool = False) -> int:
        self.log.append("write_back")
        self.sides.append(("write_back", aside))
        offload_module.copy_all(transfer.host_side, transfer.device_side)
        self.written += 1
        return self.written - 1

    def finish(self) -> None:
        self.log.append("finish")
        self.written = 0


@contextmanager
def recorded_offload(log: list[str], copiers: list[RecordingCopier] | None = None) -> Iterator[None]:
    """Every item's state treated as offloaded (as on a GPU, whose parameters' state lives on the host), staged
    through RecordingCopiers that write to `log` (and are added to `copiers`)."""
    def copier(device: torch.device) -> RecordingCopier:
        made = RecordingCopier(log)
        if copiers is not None:
            copiers.append(made)
        return made

    with mock.patch.object(offload_module, "offloaded", lambda item: True), \
            mock.patch.object(offload_module, "any_offloaded", lambda items: bool(items)), \
            mock.patch.object(offload_module, "CudaCopier", copier):
        yield
