"""Whether gradients are finite on every rank: one flag per gradient, the same on all ranks, without a host sync."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..functional import nonfinite_flags
from ..native import finite_flags
from . import comm
from .dtensors import is_dtensor, local_tensor


def finite_everywhere(local_tensors: Sequence[Tensor], group: dist.ProcessGroup) -> Tensor:
    """(N,) float32: 1.0 where the tensor is finite on every rank of `group`, else 0.0 (empty shards count as
    finite). Every rank of the group must call this with its own shards of the same tensors."""
    return comm.all_reduce_min_(finite_flags(local_tensors), group)


def found_inf_flags(grads: Sequence[Tensor]) -> Tensor:
    """(N,) float32 on the gradients' device (one device): 1.0 where a gradient has a NaN or Inf anywhere (on any
    rank, for a DTensor), else 0.0. Plain tensors are checked together in one op; DTensors take one all-reduce per
    group of ranks that shard them (replicas of a shard, as under HSDP, hold the same values and need not be asked)."""
    askers: dict[dist.ProcessGroup | None, list[int]] = {}
    for i, grad in enumerate(grads):
        mesh = grad.device_mesh if is_dtensor(grad) else None
        asker = None if mesh is None else comm.spread_group(mesh, comm.spread_mesh_dims(mesh, grad.placements))
        askers.setdefault(asker, []).append(i)
    if list(askers) == [None]:
        return nonfinite_flags(grads)
    flags: list[Tensor] = [torch.empty(0, device="cpu")] * len(grads)
    for asker, indices in askers.items():
        tensors = [local_tensor(grads[i]) for i in indices]
        finite = finite_flags(tensors) if asker is None else finite_everywhere(tensors, asker)
        for i, flag in zip(indices, finite.unbind()):
            flags[i] = 1.0 - flag
    return torch.stack(flags)
