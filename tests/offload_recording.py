"""A stand-in for the CUDA copier of `offload="cpu"`, so that the staging schedules run, and are checked, on a CPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
from kernel_under_test import optimizer, submodule

offload_module = submodule(optimizer, "offload")


class RecordingCopier:
    """The CUDA copier's interface and copies, synchronous and on the CPU: fetches fill the "device" copies, write-backs
    copy them into the homes, both as the CUDA copier does (packed homes included), so an update that read or wrote the
    homes instead of the copies would leave the homes unstepped. Each write-back's handle is its number in the step;
    `waits` holds, for each fetch, the handle it was told to wait for."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.waits: list[Any] = []
        self.written = 0

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def fetch(self, transfer: Any, after: Any = None) -> None:
        self.log.append("fetch")
        self.waits.append(after)
        offload_module.copy_all(transfer.device_side, transfer.host_side)

    def ready(self, handle: None) -> None:
        self.log.append("ready")

    def write_back(self, transfer: Any) -> int:
        self.log.append("write_back")
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
