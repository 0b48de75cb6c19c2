"""Whether gradients are finite on every rank: one flag per gradient, the same on all ranks, without a host sync."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..functional import guard_sum, nonfinite_flag
from . import comm
from .dtensors import is_dtensor, local_tensor


def finite_everywhere(local_tensors: Sequence[Tensor], group: dist.ProcessGroup) -> Tensor:
    """(N,) float32: 1.0 where the tensor is finite on every rank of `group`, else 0.0 (empty shards count as
    finite). Every rank of the group must call this with its own shards of the same tensors."""
    flags = torch.stack([guard_sum(tensor) for tensor in local_tensors]).isfinite().to(torch.float32)
    return comm.all_reduce_min_(flags, group)


def found_inf_flags(grads: Sequence[Tensor]) -> list[Tensor]:
    """Per gradient, a float32 scalar: 1.0 if it has a NaN or Inf anywhere (on any rank, for a DTensor), else 0.0.
    Plain tensors take one sum each; DTensors one all-reduce per group of ranks that shard them (replicas of
    a shard, as under HSDP, hold the same values and need not be asked)."""
    flags: list[Tensor | None] = [None if is_dtensor(grad) else nonfinite_flag(grad) for grad in grads]
    by_group: dict[dist.ProcessGroup, list[int]] = {}
    for i, grad in enumerate(grads):
        if is_dtensor(grad):
            mesh = grad.device_mesh
            by_group.setdefault(comm.spread_group(mesh, comm.spread_mesh_dims(mesh, grad.placements)), []).append(i)
    for group, indices in by_group.items():
        finite = finite_everywhere([local_tensor(grads[i]) for i in indices], group)
        for i, flag in zip(indices, finite.unbind()):
            flags[i] = 1.0 - flag
    return flags
