"""NorMuon's and AdaMuon's normalization of update shards. Each rank's second moment covers its own shard, as its
momentum does; the sums a shard cannot see alone (a row split between ranks, the RMS rule's norm of the whole update)
are added up over the group's ranks, one all-reduce each, a replicated part counted once."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..functional import MuonTensors
from ..normalization import normalize, rms_rule_scales, row_squares, second_moment_shape
from ..routing import MatrixView
from . import comm
from .dtensors import local_tensor
from .layout import Box, ShardLayout, box_numel, int_tensor_on


def normalize_shards(updates: Sequence[Tensor], items: Sequence[MuonTensors], layouts: Sequence[ShardLayout],
                     skipped: Tensor, *, rank: int, group: dist.ProcessGroup, normalization: str, beta: float,
                     eps: float, rms_rule: bool) -> tuple[list[Tensor], list[Tensor] | None]:
    """This rank's shards of the updates, normalized with their second moments (updated in place), and with the RMS
    rule each parameter's factor that gives its whole update RMS 0.2 (else None). Every rank of `group` calls this
    with the same parameters."""
    moments = [local_tensor(item.second_moment) for item in items]
    views = [item.view for item in items]
    row_sums = None
    if normalization == "neuron":
        row_sums = _whole_rows(row_squares(updates, views, moments[0].dtype), views, layouts, rank, group)
    normalized, totals = normalize(updates, row_sums, moments, [item.update_step for item in items], skipped, views,
                                   normalization, beta, eps, bias_correction=not rms_rule, sums_of_squares=rms_rule)
    if totals is None:
        return normalized, None
    if any(layout.is_sharded for layout in layouts):
        counted = int_tensor_on(tuple(int(layout.counts_once(rank)) for layout in layouts), totals.device)
        totals = comm.all_reduce_sum_(totals * counted, group)
    return normalized, rms_rule_scales(totals, views, eps)


def _whole_rows(row_squares: list[Tensor], views: Sequence[MatrixView], layouts: Sequence[ShardLayout], rank: int,
                group: dist.ProcessGroup) -> list[Tensor]:
    """Each shard's row sums completed with the other ranks' parts of its rows: every split row's partial sums go
    to their place in one buffer of all rows (in storage order), which one all-reduce adds up."""
    split = [j for j, (view, layout) in enumerate(zip(views, layouts))
             if set(layout.split_dims) & set(view.column_dims)]
    if not split:
        return row_squares
    shapes = [second_moment_shape(layouts[j].shape, views[j], "neuron") for j in split]
    boxes = [_rows_box(layouts[j].boxes[rank], views[j]) for j in split]
    flat = torch.zeros(sum(torch.Size(shape).numel() for shape in shapes), dtype=row_squares[0].dtype,
                       device=row_squares[0].device)
    pieces = list(flat.split([torch.Size(shape).numel() for shape in shapes]))
    pieces = [piece.view(shape) for piece, shape in zip(pieces, shapes)]
    for j, piece, box in zip(split, pieces, boxes):
        if box_numel(box) and layouts[j].counts_once(rank):
            piece[box] = row_squares[j]
    comm.all_reduce_sum_(flat, group)
    whole = list(row_squares)
    for j, piece, box in zip(split, pieces, boxes):
        whole[j] = piece[box]
    return whole


def _rows_box(box: Box, view: MatrixView) -> Box:
    """A rank's box of a parameter -> its box of the per-row state, where the dims a row runs along have size 1."""
    return tuple(slice(0, 1) if dim in view.column_dims else part for dim, part in enumerate(box))
