"""A stand-in for the CUDA copier of `offload="cpu"`, so that the staging schedules run, and are checked, on a CPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch
from kernel_under_test import optimizer, submodule

offload_module = submodule(optimizer, "offload")


class RecordingCopier:
    """The CUDA copier's interface, synchronous: fetches clone (the "device" copies), write-backs copy into the homes.
    An update that read or wrote the homes instead of the copies would leave the homes unstepped."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def fetch(self, homes: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        self.log.append("fetch")
        return [home.clone() for home in homes]

    def ready(self, handle: list[torch.Tensor]) -> list[torch.Tensor]:
        self.log.append("ready")
        return handle

    def write_back(self, copies: list[torch.Tensor], homes: list[torch.Tensor]) -> None:
        self.log.append("write_back")
        for copy, home in zip(copies, homes):
            home.copy_(copy)

    def finish(self) -> None:
        self.log.append("finish")


@contextmanager
def recorded_offload(log: list[str]) -> Iterator[None]:
    """Every item's state treated as offloaded (as on a GPU, whose parameters' state lives on the host), staged
    through a RecordingCopier that writes to `log`."""
    with mock.patch.object(offload_module, "offloaded", lambda item: True), \
            mock.patch.object(offload_module, "any_offloaded", lambda items: bool(items)), \
            mock.patch.object(offload_module, "CudaCopier", lambda device: RecordingCopier(log)):
        yield
