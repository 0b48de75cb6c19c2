"""One chunk of matrices through momentum -> all-to-all to owners -> Newton-Schulz -> all-to-all back -> update.

Each chunk is a generator that yields right after launching each all-to-all (and, with offloaded state, after
starting the copy of its state to the device); `run_staggered` starts one new chunk per round, so a chunk's
transfers are in flight while the chunk before it computes.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from ..functional import LearningRate, MuonTensors, momentum_step_, update_step_size
from ..newton_schulz import Orthogonalizer
from ..normalization import uses_rms_rule
from ..offload import Copier, staged, start_fetch
from . import comm
from .dtensors import local_or_none, local_tensor
from .layout import ShardLayout, box_numel, box_shape, shard_positions
from .normalize_shards import normalize_shards
from .orthogonalize import apply_update, orthogonalize
from .plan import Exchange, gather_exchange, scatter_exchange

ChunkPipeline = Generator[None, None, None]


@dataclass(frozen=True)
class SpreadSettings:
    """What every chunk of one step needs besides its matrices."""

    group: dist.ProcessGroup
    rank: int
    comm_dtype: torch.dtype
    orthogonalizer: Orthogonalizer
    momentum: float
    nesterov: bool
    lr: LearningRate
    weight_decay: float
    adjust_lr_fn: str | None
    normalize_spatial: bool
    normalization: str | None
    normalization_beta: float


@dataclass(frozen=True)
class SpreadItem:
    """One Muon parameter of the step, with its layout over the group, its owner, its local gradient (set to
    NaN when another rank's shard of it is not finite, so that every rank skips it) and whether it is finite on
    every rank (a float32 0.0 or 1.0: a rank whose shard is empty learns it only from this flag)."""

    tensors: MuonTensors
    layout: ShardLayout
    owner: int
    grad: Tensor
    finite_everywhere: Tensor


def run_staggered(pipelines: Iterable[ChunkPipeline]) -> None:
    """Admits one chunk per round and advances every admitted chunk by one stage, newest first: a new chunk's
    gather is launched before the previous chunk's Newton-Schulz runs, and that before older chunks wait."""
    active: list[ChunkPipeline] = []
    for pipeline in pipelines:
        active = _advance([pipeline, *active])
    while active:
        active = _advance(active)


def _advance(active: list[ChunkPipeline]) -> list[ChunkPipeline]:
    still_running = []
    for pipeline in active:
        try:
            next(pipeline)
            still_running.append(pipeline)
        except StopIteration:
            pass
    return still_running


def chunk_pipeline(chunk: list[SpreadItem], settings: SpreadSettings,
                   copier: Copier | None = None) -> ChunkPipeline:
    """The chunk's stages; with a `copier`, its offloaded state is fetched first and written back last."""
    if copier is not None:
        staging = start_fetch([_with_local_state(item.tensors) for item in chunk], copier)
        yield
        tensors, copies = staged(staging, copier)
        chunk = [replace(item, tensors=moved) for item, moved in zip(chunk, tensors)]
    layouts = [item.layout for item in chunk]
    owners = [item.owner for item in chunk]
    gather = gather_exchange(layouts, owners, settings.rank)
    scatter = scatter_exchange(layouts, owners, settings.rank)

    send = torch.empty(gather.send_total, dtype=settings.comm_dtype, device=chunk[0].grad.device)
    fulls, finite = _momentum_stage(chunk, gather, send, settings)
    work, received = comm.launch_all_to_all(send, gather, settings.group)
    yield
    comm.wait(work)
    for piece in gather.receives:
        fulls[piece.item][piece.box] = _piece(received, piece.offset, piece.box)
    owned = [j for j, item in enumerate(chunk) if item.owner == settings.rank]
    results = orthogonalize([chunk[j].layout.to_global(fulls[j]) for j in owned],
                            [chunk[j].tensors.view for j in owned],
                            [finite[j] for j in owned], orthogonalizer=settings.orthogonalizer,
                            out_dtype=settings.comm_dtype)
    orthogonal = {j: chunk[j].layout.to_storage(result) for j, result in zip(owned, results)}
    del fulls
    send = _pack(orthogonal, scatter, send.device, settings.comm_dtype)
    work, received = comm.launch_all_to_all(send, scatter, settings.group)
    yield
    comm.wait(work)
    received_updates = {piece.item: _piece(received, piece.offset, piece.box) for piece in scatter.receives}
    updates = [_my_update(j, item, orthogonal, received_updates, settings) for j, item in enumerate(chunk)]
    rms_scales: list[Tensor | None] = [None] * len(chunk)
    if settings.normalization is not None:
        rms_rule = uses_rms_rule(settings.normalization, settings.adjust_lr_fn)
        updates, scales = normalize_shards(updates, [item.tensors for item in chunk], layouts, finite.eq(0),
                                           rank=settings.rank, group=settings.group,
                                           normalization=settings.normalization, beta=settings.normalization_beta,
                                           eps=settings.orthogonalizer.eps, rms_rule=rms_rule)
        if scales is not None:
            rms_scales = list(scales)
    for j, (item, update, rms_scale) in enumerate(zip(chunk, updates, rms_scales)):
        step_size = update_step_size(settings.lr, settings.adjust_lr_fn, item.tensors.view,
                                     settings.normalize_spatial, rms_scale)
        apply_update(local_tensor(item.tensors.param), update, finite[j], item.tensors.nonfinite_skips,
                     lr=settings.lr, weight_decay=settings.weight_decay, step_size=step_size)
    if copier is not None:
        copier.write_back(copies, staging.homes)


def _with_local_state(tensors: MuonTensors) -> MuonTensors:
    """The item with its state as this rank's shards, the tensors an offloaded state's copies stand in for."""
    return replace(tensors, momentum_buffer=local_tensor(tensors.momentum_buffer),
                   momentum_scales=local_or_none(tensors.momentum_scales),
                   second_moment=local_or_none(tensors.second_moment))


def _my_update(j: int, item: SpreadItem, orthogonal: dict[int, Tensor], received: dict[int, Tensor],
               settings: SpreadSettings) -> Tensor:
    """This rank's shard of item j's orthogonalized update: its own result's part if it owns the item, else what
    the owner sent (nothing, for an empty shard)."""
    mine = item.layout.boxes[settings.rank]
    if j in orthogonal:
        return orthogonal[j][mine]
    if j in received:
        return received[j]
    return torch.empty(box_shape(mine), dtype=settings.comm_dtype, device=item.grad.device)


def _piece(buffer: Tensor, offset: int, box: tuple[slice, ...]) -> Tensor:
    return buffer.narrow(0, offset, box_numel(box)).view(box_shape(box))


def _momentum_stage(chunk: list[SpreadItem], gather: Exchange, send: Tensor,
                    settings: SpreadSettings) -> tuple[list[Tensor | None], Tensor]:
    """Momentum on the local shards. Each rank's update goes straight where it is needed: into the send buffer
    when it travels to the owner, into the owner's whole-matrix buffer when this rank is the owner, else (a
    replica another rank sends for) into scratch. Returns the owners' buffers and the finite flags."""
    send_at = {piece.item: piece for piece in gather.sends}
    fulls: list[Tensor | None] = [None] * len(chunk)
    outputs: list[Tensor] = []
    copies: list[tuple[Tensor, Tensor]] = []
    for j, item in enumerate(chunk):
        box = item.layout.boxes[settings.rank]
        if tuple(item.grad.shape) != box_shape(box):
            raise RuntimeError(f"Muon: the local shard of a parameter of global shape {item.layout.shape} has "
                               f"shape {tuple(item.grad.shape)}, but its placements give {box_shape(box)}")
        if item.owner == settings.rank:
            fulls[j] = torch.empty(item.layout.shape, dtype=settings.comm_dtype, device=send.device)
            target = fulls[j][box]
            if not target.is_contiguous():  # the op writes contiguous outputs: fill a temporary, copy it in
                temp = torch.empty(box_shape(box), dtype=settings.comm_dtype, device=send.device)
                copies.append((target, temp))
                target = temp
            outputs.append(target)
        elif j in send_at:
            outputs.append(_piece(send, send_at[j].offset, box))
        else:
            outputs.append(torch.empty(box_shape(box), dtype=settings.comm_dtype, device=send.device))
    finite = momentum_step_([local_tensor(item.tensors.momentum_buffer) for item in chunk],
                            [item.grad for item in chunk], outputs, settings.momentum, settings.nesterov,
                            [item.tensors.rounding_count for item in chunk],
                            [local_or_none(item.tensors.momentum_scales) for item in chunk],
                            [None if item.tensors.rounding_count is None else shard_positions(item.tensors.param)
                             for item in chunk], agreed=torch.stack([item.finite_everywhere for item in chunk]))
    for target, temp in copies:
        target.copy_(temp)
    return fulls, finite


def _pack(orthogonal: dict[int, Tensor], scatter: Exchange, device: torch.device, dtype: torch.dtype) -> Tensor:
    if not scatter.sends:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([orthogonal[piece.item][piece.box].reshape(-1) for piece in scatter.sends])
