"""A stand-in for the CUDA copier of `offload="cpu"`, so that the staging schedules run, and are checked, on a CPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch
from kernel_under_test import optimizer, submodule

offload_module = submodule(optimizer, "offload")


class RecordingCopier:
    """The CUDA copier's interface and copies, synchronous and on the CPU: fetches make the "device" copies (new
    tensors), write-backs copy into the homes, both as the CUDA copier makes them (packed homes included), so an
    update that read or wrote the homes instead of the copies would leave the homes unstepped."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def fetch(self, homes: list[torch.Tensor], device: torch.device, repack: bool = False) -> list[torch.Tensor]:
        self.log.append("fetch")
        if repack:
            offload_module.repack_homes(homes)
        return offload_module.copies_on(torch.device("cpu"), homes, repack)

    def ready(self, handle: list[torch.Tensor]) -> list[torch.Tensor]:
        self.log.append("ready")
        return handle

    def write_back(self, copies: list[torch.Tensor], homes: list[torch.Tensor], packed: bool = False) -> None:
        self.log.append("write_back")
        offload_module.copy_all(homes, copies, packed)

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
