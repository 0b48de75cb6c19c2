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
from ..routing import MatrixView
from . import comm
from .assignment import COLUMNS, Share
from .dtensors import local_or_none, local_tensor
from .layout import Box, ShardLayout, box_numel, box_shape, shard_positions, within
from .normalize_shards import normalize_shards
from .orthogonalize import apply_update, orthogonalize
from .plan import Exchange, chunk_exchanges
from .split_newton_schulz import split_newton_schulz

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
    adjust_lr_fn: str | None
    normalize_spatial: bool
    normalization: str | None
    normalization_beta: float


@dataclass(frozen=True)
class SpreadItem:
    """One Muon parameter of the step, with its layout over the group, the shares its owners orthogonalize, its
    local gradient (set to NaN when another rank's shard of it is not finite, so that every rank skips it) and
    whether it is finite on every rank (a float32 0.0 or 1.0: a rank whose shard is empty learns it only from this
    flag), and its param group's lr and weight decay."""

    tensors: MuonTensors
    layout: ShardLayout
    shares: tuple[Share, ...]
    grad: Tensor
    finite_everywhere: Tensor
    lr: LearningRate
    weight_decay: float


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
        chunk = [replace(item, tensors=moved) for item, moved in zip(chunk, staged(staging, copier))]
    layouts = [item.layout for item in chunk]
    gather, scatter = chunk_exchanges(tuple(layouts), tuple(item.shares for item in chunk), settings.rank)

    send = torch.empty(gather.send_total, dtype=settings.comm_dtype, device=chunk[0].grad.device)
    parts, finite = _momentum_stage(chunk, gather, send, settings)
    work, received = comm.launch_all_to_all(send, gather, settings.group)
    yield
    comm.wait(work)
    for piece in gather.receives:
        share_box = _share_box(chunk, piece.item, piece.share)
        parts[piece.item, piece.share][within(piece.box, share_box)] = _piece(received, piece.offset, piece.box)
    orthogonal = yield from _orthogonalized(chunk, parts, finite, settings)
    del parts
    send = _pack(chunk, orthogonal, scatter, send.device, settings.comm_dtype)
    work, received = comm.launch_all_to_all(send, scatter, settings.group)
    yield
    comm.wait(work)
    arrived: dict[int, list[tuple[Tensor, Box]]] = {}  # item -> (part of this rank's update, its box)
    for kept in scatter.kept:
        part = orthogonal[kept.item, kept.share][within(kept.box, _share_box(chunk, kept.item, kept.share))]
        arrived.setdefault(kept.item, []).append((part, kept.box))
    for piece in scatter.receives:
        arrived.setdefault(piece.item, []).append((_piece(received, piece.offset, piece.box), piece.box))
    updates = [_my_update(item, arrived.get(j, []), settings) for j, item in enumerate(chunk)]
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
        step_size = update_step_size(item.lr, settings.adjust_lr_fn, item.tensors.view, settings.normalize_spatial,
                                     rms_scale)
        apply_update(local_tensor(item.tensors.param), update, finite[j], item.tensors.nonfinite_skips,
                     lr=item.lr, weight_decay=item.weight_decay, step_size=step_size)
    if copier is not None:
        copier.write_back(staging.group.transfer)


def _with_local_state(tensors: MuonTensors) -> MuonTensors:
    """The item with its state as this rank's shards, the tensors an offloaded state's copies stand in for."""
    return replace(tensors, momentum_buffer=local_tensor(tensors.momentum_buffer),
                   momentum_scales=local_or_none(tensors.momentum_scales),
                   second_moment=local_or_none(tensors.second_moment))


def _orthogonalized(chunk: list[SpreadItem], parts: dict[tuple[int, int], Tensor], finite: Tensor,
                    settings: SpreadSettings) -> Generator[None, None, dict[tuple[int, int], Tensor]]:
    """The orthogonalized shares this rank owns, keyed and laid out as `parts`, in the comm dtype: whole matrices
    and expert shares in batched calls, then (yielding after each exchange) the column shares of divided matrices,
    whose exchanges every rank launches when the chunk has any."""
    whole = [key for key in parts if chunk[key[0]].shares[key[1]].kind != COLUMNS]
    results = orthogonalize([chunk[j].layout.to_global(parts[j, s]) for j, s in whole],
                            [_share_view(chunk[j], s) for j, s in whole], [finite[j] for j, _ in whole],
                            orthogonalizer=settings.orthogonalizer, out_dtype=settings.comm_dtype)
    orthogonal = {(j, s): chunk[j].layout.to_storage(result) for (j, s), result in zip(whole, results)}
    divided = [j for j, item in enumerate(chunk) if item.shares[0].kind == COLUMNS]
    if divided:
        columns = {key: chunk[key[0]].layout.to_global(part).to(settings.orthogonalizer.staging_dtype(part.dtype))
                   for key, part in parts.items() if key not in orthogonal}
        blocks = yield from split_newton_schulz(
            columns, {j: tuple(share.owner for share in chunk[j].shares) for j in divided},
            {j: (chunk[j].tensors.view.rows, chunk[j].tensors.view.cols) for j in divided},
            {j: finite[j] for j in divided}, orthogonalizer=settings.orthogonalizer, rank=settings.rank,
            world=chunk[0].layout.world, group=settings.group, device=chunk[0].grad.device)
        orthogonal |= {(j, s): chunk[j].layout.to_storage(block).to(settings.comm_dtype)
                       for (j, s), block in blocks.items()}
    return orthogonal


def _share_view(item: SpreadItem, share: int) -> MatrixView:
    """The matrix view of a share: the whole item's, or a bank's with the share's experts."""
    part = item.shares[share]
    return item.tensors.view if part.kind is None else replace(item.tensors.view, batch=part.stop - part.start)


def _share_box(chunk: list[SpreadItem], item: int, share: int) -> Box:
    return chunk[item].shares[share].box(chunk[item].layout.shape)


def _my_update(item: SpreadItem, parts: list[tuple[Tensor, Box]], settings: SpreadSettings) -> Tensor:
    """This rank's shard of the item's orthogonalized update from its parts (from the shares this rank owns and
    what their owners sent; none for an empty shard): that part when one covers it, else assembled."""
    mine = item.layout.boxes[settings.rank]
    if len(parts) == 1 and parts[0][1] == mine:
        # Contiguous, as a received part is: a tall matrix's own part is a transposed view of its Newton-Schulz
        # buffer, and replicas (DDP, Replicate) normalizing the two layouts reduced in different orders and drifted.
        return parts[0][0].contiguous()
    update = torch.empty(box_shape(mine), dtype=settings.comm_dtype, device=item.grad.device)
    for part, box in parts:
        update[within(box, mine)] = part
    return update


def _piece(buffer: Tensor, offset: int, box: tuple[slice, ...]) -> Tensor:
    return buffer.narrow(0, offset, box_numel(box)).view(box_shape(box))


def _momentum_stage(chunk: list[SpreadItem], gather: Exchange, send: Tensor, settings: SpreadSettings
                    ) -> tuple[dict[tuple[int, int], Tensor], Tensor]:
    """Momentum on the local shards. Each rank's update goes straight where it is needed when it goes whole to one
    place: into the send buffer when it travels to a share's owner, into the share's buffer when this rank owns
    it; else (split between shares, or a replica another rank sends for) into scratch, then copied where it goes.
    Returns the buffers of the shares this rank owns, keyed (item, share), and the finite flags."""
    parts = {(j, index): torch.empty(box_shape(share.box(item.layout.shape)), dtype=settings.comm_dtype,
                                     device=send.device)
             for j, item in enumerate(chunk) for index, share in enumerate(item.shares) if share.owner == settings.rank}
    destinations: dict[int, list[tuple[Tensor, Box]]] = {}
    for piece in gather.sends:
        destinations.setdefault(piece.item, []).append((_piece(send, piece.offset, piece.box), piece.box))
    for kept in gather.kept:
        part = parts[kept.item, kept.share][within(kept.box, _share_box(chunk, kept.item, kept.share))]
        destinations.setdefault(kept.item, []).append((part, kept.box))
    outputs: list[Tensor] = []
    copies: list[tuple[Tensor, Tensor]] = []
    for j, item in enumerate(chunk):
        box = item.layout.boxes[settings.rank]
        if tuple(item.grad.shape) != box_shape(box):
            raise RuntimeError(f"Muon: the local shard of a parameter of global shape {item.layout.shape} has "
                               f"shape {tuple(item.grad.shape)}, but its placements give {box_shape(box)}")
        targets = destinations.get(j, [])
        if len(targets) == 1 and targets[0][1] == box and targets[0][0].is_contiguous():
            outputs.append(targets[0][0])  # the op writes contiguous outputs
            continue
        scratch = torch.empty(box_shape(box), dtype=settings.comm_dtype, device=send.device)
        copies += [(target, scratch[within(target_box, box)]) for target, target_box in targets]
        outputs.append(scratch)
    finite = momentum_step_([local_tensor(item.tensors.momentum_buffer) for item in chunk],
                            [item.grad for item in chunk], outputs, settings.momentum, settings.nesterov,
                            [item.tensors.rounding_count for item in chunk],
                            [local_or_none(item.tensors.momentum_scales) for item in chunk],
                            [None if item.tensors.rounding_count is None else shard_positions(item.tensors.param)
                             for item in chunk], agreed=torch.stack([item.finite_everywhere for item in chunk]))
    for target, scratch in copies:
        target.copy_(scratch)
    return parts, finite


def _pack(chunk: list[SpreadItem], orthogonal: dict[tuple[int, int], Tensor], scatter: Exchange,
          device: torch.device, dtype: torch.dtype) -> Tensor:
    if not scatter.sends:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([orthogonal[piece.item, piece.share][within(piece.box, _share_box(chunk, piece.item, piece.share))]
                      .reshape(-1) for piece in scatter.sends])
