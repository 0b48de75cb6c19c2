"""Scratch memory a CPU step reuses from bucket to bucket and from step to step instead of allocating it anew."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


class Workspace:
    """Named blocks of scratch memory on the CPU, each grown to the largest request and viewed at each request's
    shape and dtype; elsewhere (GPUs, torch.compile) a request is a fresh `torch.empty`.

    glibc hands a freed block above its mmap threshold (32 MiB at most) back to the kernel, so on a CPU every fresh
    tensor that size is faulted in page by page again: on GPT-2's (12, 768, 3072) bf16 bucket a fresh X cost as much
    as the product that fills it (2-core Xeon with AMX: `bmm` 37 ms into a new tensor, 20 ms into a used one), and a
    step of the GPT-2-small set faulted in ~400 MB. GPUs' caching allocators reuse memory already, and under
    torch.compile the compiler plans memory. Blocks outlive the step (the price: the largest chunk's Newton-Schulz
    tensors stay allocated between steps, 81 MiB for GPT-2 small in bfloat16), and a block's contents are only valid
    until its name is requested again, so a caller finishes with one bucket before the next asks.
    """

    def __init__(self) -> None:
        self._blocks: dict[tuple[torch.device, str], Tensor] = {}
        # Each block's last view, handed out again for the same shape and dtype: a slice and two views per request
        # were most of a lone small matrix's stack request (~10 us of its step's ~170 us of host time, 2-core AMD EPYC).
        self._views: dict[tuple[torch.device, str], Tensor] = {}

    @staticmethod
    def serves(device: torch.device) -> bool:
        return device.type == "cpu" and not torch.compiler.is_compiling()

    def tensor(self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """An uninitialized contiguous tensor: the block `name` on the CPU, else a fresh one."""
        if not self.serves(device):
            return torch.empty(tuple(shape), dtype=dtype, device=device)
        key, shape = (device, name), tuple(shape)
        view = self._views.get(key)
        if view is not None and view.dtype == dtype and view.shape == shape:
            return view
        nbytes = math.prod(shape) * dtype.itemsize
        block = self._blocks.get(key)
        if block is None or block.numel() < nbytes:
            block = self._blocks[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        view = self._views[key] = block[:nbytes].view(dtype).view(shape)
        return view
