"""The distributed Muon step for one parameter group: parameters that are DTensors, or plain tensors replicated
over a process group (DDP), grouped by the ranks they live on and sent through the chunked all-to-all pipeline;
expert banks whose ranks hold whole experts are updated where they are."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .. import offload
from ..functional import LearningRate, MuonTensors, Rates
from ..newton_schulz import Orthogonalizer
from ..normalization import uses_rms_rule
from . import comm
from .assignment import plan_spread
from .dtensors import (Placement, is_dtensor, is_shard, local_or_none, local_tensor, misplaced_strided_runs,
                       placed_like)
from .finite import finite_everywhere
from .layout import ShardLayout, int_tensor_on, replicated_layout, shard_positions, sharded_layout
from .pipeline import SpreadItem, SpreadSettings, chunk_pipeline, run_staggered


def is_spread(param: Tensor, process_group: dist.ProcessGroup | None) -> bool:
    """Whether the distributed step handles this parameter: a DTensor, or any tensor when a group is given."""
    return is_dtensor(param) or process_group is not None


# Run eagerly under torch.compile (a graph break, as the AdamW part takes): dynamo cannot trace the layouts' reading
# of DTensor placements (it failed the first compiled step of an FSDP2 model), and the collectives between ranks
# leave little for a graph to fuse.
@torch.compiler.disable
def distributed_muon_update(items: Sequence[MuonTensors], *, process_group: dist.ProcessGroup | None,
                            comm_dtype: torch.dtype, chunk_size: int | None, lr: LearningRate | Sequence[float],
                            weight_decay: float | Sequence[float], momentum: float, nesterov: bool,
                            orthogonalizer: Orthogonalizer, adjust_lr_fn: str | None, normalize_spatial: bool,
                            normalization: str | None, normalization_beta: float,
                            schedule: offload.StagedUpdates | None = None) -> None:
    """Muon's update for parameters spread over ranks, with the single-device result (up to `comm_dtype`
    rounding). DTensors run over the mesh dims that shard them (see `comm.spread_mesh_dims`), plain tensors over
    `process_group`. Parameters whose every rank holds whole matrices (expert banks sharded on the expert dim)
    are orthogonalized where they are, with no transfer, unless the RMS rule of a normalization needs the norm of
    the whole update or their holders would carry more than the mean work (`assignment.plan_spread`). Every rank
    of those groups must call this with the same parameters in the same order. `lr` and `weight_decay`: one for
    all, or numbers one per item (`muon_update`'s), so that param groups which differ only in them share the
    plan, its chunks and their collectives. With offloaded state, the matrices updated in place stage it in
    `schedule` (the step's, run after its last update; None where the optimizer does not offload), the
    pipeline's chunks in their own."""
    rms_rule = uses_rms_rule(normalization, adjust_lr_fn)
    iteration = (len(orthogonalizer.coefficients), orthogonalizer.algorithm, orthogonalizer.dtype)
    rates = Rates(items, lr, weight_decay)
    for (group, dims), group_items in _by_group(items, process_group).items():
        rank, world = comm.rank_and_world(group)
        layouts = [_layout(item.param, group, dims, world) for item in group_items]
        grads, everywhere = _agreed_local_grads(group_items, layouts, group)
        flags = everywhere.unbind()
        plan = plan_spread(tuple(item.view for item in group_items), tuple(layouts), world, *iteration,
                           group_items[0].param.device.type, chunk_size, keep_banks=not rms_rule)
        _update_in_place([(item, grad, flag) for item, grad, flag, local in
                          zip(group_items, grads, flags, plan.in_place) if local], rates, schedule,
                         lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                         orthogonalizer=orthogonalizer, adjust_lr_fn=adjust_lr_fn,
                         normalize_spatial=normalize_spatial, normalization=normalization,
                         normalization_beta=normalization_beta)
        if not plan.spread:
            continue
        spread_lrs, spread_decays = rates.of([group_items[j] for j in plan.spread])
        spread = [SpreadItem(group_items[j], layouts[j], item_shares, grads[j], flags[j], item_lr, decay)
                  for j, item_shares, item_lr, decay in zip(plan.spread, plan.shares, spread_lrs, spread_decays)]
        settings = SpreadSettings(group, rank, comm_dtype, orthogonalizer, momentum, nesterov, adjust_lr_fn,
                                  normalize_spatial, normalization, normalization_beta)
        copier = (offload.CudaCopier(spread[0].grad.device)
                  if any(offload.offloaded(item.tensors) for item in spread) else None)
        run_staggered(chunk_pipeline([spread[i] for i in chunk], settings, copier) for chunk in plan.chunks)
        if copier is not None:
            copier.finish()


def _by_group(items: Sequence[MuonTensors], process_group: dist.ProcessGroup | None
              ) -> dict[tuple[dist.ProcessGroup, tuple[int, ...]], list[MuonTensors]]:
    """Items keyed by the process group their update runs over and, for DTensors, the mesh dims it spans."""
    groups: dict[tuple[dist.ProcessGroup, tuple[int, ...]], list[MuonTensors]] = {}
    for item in items:
        key: tuple[dist.ProcessGroup, tuple[int, ...]] = (process_group, ())
        if is_dtensor(item.param):
            _check_placements(item.param)
            mesh = item.param.device_mesh
            dims = comm.spread_mesh_dims(mesh, item.param.placements)
            key = (comm.spread_group(mesh, dims), dims)
        groups.setdefault(key, []).append(item)
    return groups


def _check_placements(param: Tensor) -> None:
    for placement in param.placements:
        if not (placement.is_replicate() or is_shard(placement)):
            raise RuntimeError(f"Muon: parameter of shape {tuple(param.shape)} has placement {placement!r} on mesh "
                               f"{param.device_mesh}; supported are Shard(dim), _StridedShard and Replicate()")


def check_spread_param(param: Tensor) -> None:
    """What a distributed update refuses of a DTensor parameter, asked of every one before any update: a placement
    it cannot spread over, strided runs its torch misplaces (`misplaced_strided_runs`), or a local shard other than its
    placements give (`DTensor.from_local` with `run_check=False` trusts the caller), which the update meets only at
    the parameter's chunk."""
    _check_placements(param)
    misplaced = misplaced_strided_runs(tuple(param.shape), tuple(param.device_mesh.shape), tuple(param.placements))
    if misplaced is not None:
        raise RuntimeError(f"Muon: a parameter of shape {tuple(param.shape)}: {misplaced}")
    expected = _local_shape(tuple(param.shape), param.device_mesh, tuple(param.placements))
    if tuple(local_tensor(param).shape) != expected:
        raise RuntimeError(f"Muon: the local shard of a parameter of global shape {tuple(param.shape)} has shape "
                           f"{tuple(local_tensor(param).shape)}, but its placements give {expected}")


@lru_cache(maxsize=4096)
def _local_shape(shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[Placement, ...]) -> tuple[int, ...]:
    """This rank's shard shape as DTensor gives it. Cached: asked of every parameter at every step, torch's answer
    took 25 us a `Shard(0)` parameter and 180 us a strided one (FSDP2 over TP), 7 and 53 ms of host time a step for
    Llama-3-8B's 291 tensors (2-core AMD EPYC)."""
    return tuple(compute_local_shape_and_global_offset(shape, mesh, placements)[0])


def _layout(param: Tensor, group: dist.ProcessGroup, dims: tuple[int, ...], world: int) -> ShardLayout:
    if not is_dtensor(param):
        return replicated_layout(tuple(param.shape), world)
    mesh = param.device_mesh
    return sharded_layout(tuple(param.shape), tuple(mesh.shape[i] for i in dims),
                          tuple(param.placements[i] for i in dims), comm.spread_group_ranks(mesh, dims, group))


def _agreed_local_grads(items: Sequence[MuonTensors], layouts: Sequence[ShardLayout],
                        group: dist.ProcessGroup) -> tuple[list[Tensor], Tensor]:
    """Local gradient shards and (N,) float32 flags: 0.0 where a sharded matrix is not finite on SOME rank, else
    1.0. Such a matrix's shards are set to NaN on every rank, so that the momentum op skips the whole matrix
    everywhere; the flag also tells ranks with an empty shard. One all-reduce of flags, no host sync."""
    grads = [local_tensor(placed_like(item.grad, item.param)).contiguous() for item in items]
    everywhere = torch.ones(len(items), dtype=torch.float32, device=grads[0].device)
    sharded = [j for j, layout in enumerate(layouts) if layout.is_sharded]
    if not sharded:  # every rank holds the whole gradient: each already sees what the others see
        return grads, everywhere
    flags = finite_everywhere([grads[j] for j in sharded], group)
    everywhere.index_copy_(0, int_tensor_on(tuple(sharded), everywhere.device), flags)
    for j, flag in zip(sharded, flags.unbind()):
        grads[j] = torch.where(flag > 0, grads[j], math.nan)
    return grads, everywhere


def _update_in_place(items: Sequence[tuple[MuonTensors, Tensor, Tensor]], rates: Rates,
                     schedule: offload.StagedUpdates | None, **settings) -> None:
    """Single-device Muon on each rank's own whole matrices of (item, agreed local grad, agreed flag), each at its
    rates; with offloaded state, staged in `schedule` as one device's are."""
    local_items = []
    updated = []
    for item, grad, flag in items:
        param = local_tensor(item.param)
        if param.numel() == 0:  # no matrices here, but the step counts must agree with the other ranks'
            item.nonfinite_skips.add_(flag.eq(0))
            if item.update_step is not None:
                item.update_step.add_(flag)
            if item.rounding_count is not None:
                item.rounding_count.add_(flag.to(item.rounding_count.dtype))
            continue
        view = replace(item.view, batch=param.numel() // (item.view.rows * item.view.cols))
        positions = None if item.rounding_count is None else shard_positions(item.param)
        local_items.append(MuonTensors(param, grad, local_tensor(item.momentum_buffer), item.nonfinite_skips, view,
                                       local_or_none(item.second_moment), item.update_step, item.rounding_count,
                                       local_or_none(item.momentum_scales), positions))
        updated.append(item)
    if local_items:
        offload.staged_muon_update(local_items, schedule=schedule, **rates.settings_for(updated, settings))
