"""The distributed Muon step for one parameter group: parameters that are DTensors, or plain tensors replicated
over a process group (DDP), grouped by the ranks they live on and sent through the chunked all-to-all pipeline."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..coefficients import Coefficients
from ..functional import MuonTensors
from . import comm
from .assignment import assign_owners, by_decreasing_cost, newton_schulz_cost
from .dtensors import Placement, is_dtensor, local_tensor, shard_dim
from .finite import finite_everywhere
from .layout import ShardLayout, replicated_layout, sharded_layout
from .pipeline import SpreadItem, SpreadSettings, chunk_pipeline, run_staggered

# Each rank owns about this many matrices per chunk: enough for the owner to batch same-shape matrices, few enough
# that a step has several chunks whose communication and compute overlap.
_MATRICES_PER_RANK_PER_CHUNK = 2


def is_spread(param: Tensor, process_group: dist.ProcessGroup | None) -> bool:
    """Whether the distributed step handles this parameter: a DTensor, or any tensor when a group is given."""
    return is_dtensor(param) or process_group is not None


def distributed_muon_update(items: Sequence[MuonTensors], *, process_group: dist.ProcessGroup | None,
                            comm_dtype: torch.dtype, chunk_size: int | None, lr: float, weight_decay: float,
                            momentum: float, nesterov: bool, coefficients: list[Coefficients], eps: float,
                            adjust_lr_fn: str | None, ns_dtype: torch.dtype) -> None:
    """Muon's update for parameters spread over ranks, with the single-device result (up to `comm_dtype`
    rounding). DTensors run over their device mesh, plain tensors over `process_group`. Every rank of those
    groups must call this with the same parameters in the same order."""
    for group, group_items in _by_group(items, process_group).items():
        rank, world = comm.rank_and_world(group)
        layouts = [_layout(item.param, group, world) for item in group_items]
        grads = _agreed_local_grads(group_items, layouts, group)
        costs = [newton_schulz_cost(item.view) for item in group_items]
        owners = assign_owners(costs, world)
        spread = [SpreadItem(item, layout, owner, grad)
                  for item, layout, owner, grad in zip(group_items, layouts, owners, grads)]
        ordered = [spread[i] for i in by_decreasing_cost(costs)]
        size = chunk_size or _MATRICES_PER_RANK_PER_CHUNK * world
        settings = SpreadSettings(group, rank, comm_dtype, ns_dtype, coefficients, eps, momentum, nesterov, lr,
                                  weight_decay, adjust_lr_fn)
        run_staggered(chunk_pipeline(ordered[start:start + size], settings)
                      for start in range(0, len(ordered), size))


def _by_group(items: Sequence[MuonTensors],
              process_group: dist.ProcessGroup | None) -> dict[dist.ProcessGroup, list[MuonTensors]]:
    groups: dict[dist.ProcessGroup, list[MuonTensors]] = {}
    for item in items:
        group = comm.mesh_group(item.param.device_mesh) if is_dtensor(item.param) else process_group
        groups.setdefault(group, []).append(item)
    return groups


def _layout(param: Tensor, group: dist.ProcessGroup, world: int) -> ShardLayout:
    if not is_dtensor(param):
        return replicated_layout(param.shape, world)
    mesh = param.device_mesh
    shard_dims = [_shard_dim(param, placement) for placement in param.placements]
    return sharded_layout(param.shape, mesh.shape, shard_dims, comm.mesh_group_ranks(mesh, group))


def _shard_dim(param: Tensor, placement: Placement) -> int | None:
    """The tensor dim a placement shards, None for Replicate; other placements are refused."""
    if placement.is_replicate():
        return None
    dim = shard_dim(placement)
    if dim is not None:
        return dim % param.ndim
    raise RuntimeError(f"Muon: parameter of shape {tuple(param.shape)} has placement {placement!r} on mesh "
                       f"{param.device_mesh}; supported are Shard(dim) and Replicate()")


def _agreed_local_grads(items: Sequence[MuonTensors], layouts: Sequence[ShardLayout],
                        group: dist.ProcessGroup) -> list[Tensor]:
    """Local gradient shards, with the shards of a matrix that is not finite on SOME rank set to NaN on every
    rank, so that the momentum op skips the whole matrix everywhere (one all-reduce of flags, no host sync)."""
    grads = [local_tensor(_placed_like_param(item)).contiguous() for item in items]
    sharded = [j for j, layout in enumerate(layouts) if layout.is_sharded]
    if not sharded:  # every rank holds the whole gradient: each already sees what the others see
        return grads
    flags = finite_everywhere([grads[j] for j in sharded], group)
    for j, flag in zip(sharded, flags.unbind()):
        grads[j] = torch.where(flag > 0, grads[j], math.nan)
    return grads


def _placed_like_param(item: MuonTensors) -> Tensor:
    """The gradient with the parameter's placements (a tensor-parallel gradient may arrive Partial)."""
    grad, param = item.grad, item.param
    if is_dtensor(grad) and tuple(grad.placements) != tuple(param.placements):
        return grad.redistribute(param.device_mesh, param.placements)
    return grad
