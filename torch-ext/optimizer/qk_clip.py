"""QK-clip (MuonClip, Kimi K2, arXiv 2507.20534): after the update, shrink the query and key projections of every
attention head whose largest attention logit exceeded a threshold, so that its logits fall back under it.

A head h with max logit S_h > threshold gets gamma_h = threshold / S_h; its query rows and its key rows are each
scaled by sqrt(gamma_h), which scales every logit q.k of that head by gamma_h. With grouped-query attention a key head
serves several query heads, so its rows take the smallest gamma of its group (the group's largest logit): every
clipped query head then ends at or under the threshold, and an unclipped head that shares a key head with a clipped
one shrinks by that key scale. Heads of groups without a clipped head are left bit for bit as they were.

Everything runs on the device (no host sync). Weights may be DTensors sharded on any dim: each rank scales its local
rows by the scales of their global row indices.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .distributed.comm import mesh_group
from .distributed.dtensors import is_dtensor, is_shard, local_tensor, misplaced_strided_runs
from .distributed.layout import local_indices
from .option_values import as_real

DEFAULT_THRESHOLD = 100.0  # Kimi K2's tau


@dataclass(frozen=True)
class QKClipLayer:
    """One attention layer's query and key projections, as tensors or as parameter names known to the optimizer.

    Weights are stored (out, in) as nn.Linear does: query rows are head-major (head h owns rows
    h * head_dim ... (h + 1) * head_dim), num_heads * head_dim of them; key rows likewise, num_kv_heads * head_dim.
    Query head h reads key head h // (num_heads // num_kv_heads), as Hugging Face's `repeat_kv` arranges.
    Biases, when the projections have them, scale with their rows (else the logit would not scale exactly).
    """

    query: Tensor | str
    key: Tensor | str
    num_heads: int
    head_dim: int
    num_kv_heads: int | None = None  # None: as many as query heads (multi-head attention)
    query_bias: Tensor | str | None = None
    key_bias: Tensor | str | None = None

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads


def check_threshold(threshold: Any) -> float:
    """The threshold as a float, if it is a finite number > 0 (in any form `as_real` reads)."""
    value = as_real(threshold)
    if value is None or not (math.isfinite(value) and value > 0):
        raise ValueError(f"Invalid qk_clip_threshold: {threshold!r} (expected a finite number > 0)")
    return value


def resolve_layers(layers: Mapping[Hashable, QKClipLayer],
                   named: Mapping[str, Tensor]) -> dict[Hashable, QKClipLayer]:
    """The layers with parameter names replaced by the parameters, every shape checked."""
    resolved = {}
    for name, layer in layers.items():
        _check_type(name, layer)
        fields = {field: _resolve(name, field, getattr(layer, field), named)
                  for field in ("query", "key", "query_bias", "key_bias")}
        resolved[name] = replace(layer, **fields)
        _check_layer(name, resolved[name])
    return resolved


def _resolve(layer_name: Hashable, field: str, value: Tensor | str | None,
             named: Mapping[str, Tensor]) -> Tensor | None:
    if not isinstance(value, str):
        return value
    if value not in named:
        raise ValueError(f"Invalid qk_clip[{layer_name!r}].{field}: {value!r} is not the name of a parameter of "
                         "this optimizer (name parameters with model.named_parameters() or muon_param_groups)")
    return named[value]


def _check_type(name: Hashable, layer: Any) -> None:
    if not isinstance(layer, QKClipLayer):
        raise ValueError(f"Invalid qk_clip[{name!r}]: {layer!r} (expected a QKClipLayer)")


def _check_layer(name: Hashable, layer: QKClipLayer) -> None:
    for field in ("num_heads", "head_dim", "kv_heads"):
        value = getattr(layer, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Invalid qk_clip[{name!r}].{field}: {value!r} (expected an integer >= 1)")
    if layer.num_heads % layer.kv_heads:
        raise ValueError(f"Invalid qk_clip[{name!r}].num_kv_heads: {layer.kv_heads} does not divide num_heads "
                         f"{layer.num_heads}")
    for field, heads, ndim in (("query", layer.num_heads, 2), ("key", layer.kv_heads, 2),
                               ("query_bias", layer.num_heads, 1), ("key_bias", layer.kv_heads, 1)):
        tensor = getattr(layer, field)
        if tensor is None and ndim == 1:
            continue
        if isinstance(tensor, str):
            raise ValueError(f"Invalid qk_clip[{name!r}].{field}: {tensor!r} is a parameter's name, which only Muon "
                             "resolves (qk_clip_ takes the tensors)")
        if not isinstance(tensor, Tensor) or tensor.ndim != ndim or tensor.shape[0] != heads * layer.head_dim:
            shape = tuple(tensor.shape) if isinstance(tensor, Tensor) else tensor
            raise ValueError(f"Invalid qk_clip[{name!r}].{field}: shape {shape} (expected {ndim}D with "
                             f"{heads} * {layer.head_dim} = {heads * layer.head_dim} rows)")
        _check_placements(f"qk_clip[{name!r}].{field}", tensor)


def _check_placements(name: str, tensor: Tensor) -> None:
    """A DTensor projection's placements are ones the clip finds its local rows under (`local_indices`): checked when
    the layers are given, not after a step's update."""
    if not is_dtensor(tensor):
        return
    for placement in tensor.placements:
        if not placement.is_replicate() and not is_shard(placement):
            raise ValueError(f"Invalid {name}: placement {placement!r} (QK-clip takes Shard(dim), _StridedShard(dim) "
                             "and Replicate(): a parameter's own values, not pending partial sums)")
    misplaced = misplaced_strided_runs(tuple(tensor.shape), tuple(tensor.device_mesh.shape), tuple(tensor.placements))
    if misplaced is not None:
        raise ValueError(f"Invalid {name}: shape {tuple(tensor.shape)}: {misplaced}")


@torch.no_grad()  # the weights are a model's leaf parameters: scaled in place, as an optimizer's step does
def qk_clip_(layers: Mapping[Hashable, QKClipLayer], qk_logits: Mapping[Hashable, Tensor], threshold: float,
             process_group: dist.ProcessGroup | None = None) -> None:
    """Clips, in place, the layers named in `qk_logits` (layer key -> per-query-head max logits, shape
    (num_heads,)); layers not named are left alone. Logits are first reduced with MAX over the ranks that hold a
    layer's weights (a DTensor's mesh; `process_group` for replicated plain tensors), so every rank applies the
    same scales: every such rank must pass the same keys. Non-finite logits clip nothing. The threshold, the layers
    named and the logits are checked before any weight changes."""
    threshold = check_threshold(threshold)
    check_qk_logits(layers, qk_logits)
    for name in qk_logits:
        _check_layer(name, layers[name])
    clip_checked_(layers, qk_logits, threshold, process_group)


def clip_checked_(layers: Mapping[Hashable, QKClipLayer], qk_logits: Mapping[Hashable, Tensor], threshold: float,
                  process_group: dist.ProcessGroup | None = None) -> None:
    """`qk_clip_` of layers, logits and a threshold already checked (`Muon` checks its layers and threshold once and
    the logits before its update). The scales are computed in float32, or float64 for float64 weights."""
    logits = {name: value.detach().to(device=(query := local_tensor(layers[name].query)).device,
                                      dtype=torch.promote_types(query.dtype, torch.float32), non_blocking=True)
              for name, value in qk_logits.items()}
    _all_reduce_max_(logits, layers, process_group)
    for name, layer_logits in logits.items():
        _clip_layer(layers[name], layer_logits, threshold)


def check_qk_logits(layers: Mapping[Hashable, QKClipLayer], qk_logits: Mapping[Hashable, Tensor]) -> None:
    """Raises ValueError for a key that names no layer or logits that are not one real value per query head."""
    if not isinstance(qk_logits, Mapping):
        raise ValueError(f"Invalid qk_logits: a {type(qk_logits).__name__} (expected a mapping of layer key -> "
                         "max logits per query head)")
    for name, value in qk_logits.items():
        if name not in layers:
            configured = f"configured: {list(layers)}" if layers else "no qk_clip layers are configured"
            raise ValueError(f"Invalid qk_logits key {name!r}: no such QK-clip layer ({configured})")
        _check_type(name, layers[name])
        heads = layers[name].num_heads
        if not isinstance(value, Tensor) or tuple(value.shape) != (heads,):
            shape = tuple(value.shape) if isinstance(value, Tensor) else value
            raise ValueError(f"Invalid qk_logits[{name!r}]: shape {shape} (expected ({heads},), one max logit "
                             "per query head)")
        if not value.is_floating_point():
            raise ValueError(f"Invalid qk_logits[{name!r}]: dtype {value.dtype} (expected a real floating dtype)")


def _reduction_group(weight: Tensor, process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    return mesh_group(weight.device_mesh) if is_dtensor(weight) else process_group


def _all_reduce_max_(logits: dict[Hashable, Tensor], layers: Mapping[Hashable, QKClipLayer],
                     process_group: dist.ProcessGroup | None) -> None:
    """One MAX all-reduce per process group, over all of that group's layers at once."""
    by_group: dict[dist.ProcessGroup, list[Hashable]] = {}
    for name in logits:
        group = _reduction_group(layers[name].query, process_group)
        if group is not None and dist.get_world_size(group) > 1:
            by_group.setdefault(group, []).append(name)
    for group, names in by_group.items():
        flat = torch.cat([logits[name] for name in names])
        # NaN would win a MAX and then clip nothing, yet a finite logit of another rank may need clipping.
        flat = torch.nan_to_num(flat, nan=-math.inf)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        for name, part in zip(names, flat.split([logits[name].numel() for name in names])):
            logits[name] = part


def _clip_layer(layer: QKClipLayer, max_logits: Tensor, threshold: float) -> None:
    exceeds = torch.isfinite(max_logits) & (max_logits > threshold)
    gamma = torch.where(exceeds, threshold / max_logits, 1.0)
    key_gamma = gamma.view(layer.kv_heads, layer.num_heads // layer.kv_heads).amin(dim=1)
    query_rows = gamma.sqrt().repeat_interleave(layer.head_dim)
    key_rows = key_gamma.sqrt().repeat_interleave(layer.head_dim)
    for tensor, row_scales in ((layer.query, query_rows), (layer.key, key_rows),
                               (layer.query_bias, query_rows), (layer.key_bias, key_rows)):
        if tensor is not None:
            _scale_rows_(tensor, row_scales)


def _scale_rows_(tensor: Tensor, row_scales: Tensor) -> None:
    """Multiplies each of the rank's local rows by the scale of its global row (an exact no-op where it is 1). The
    scales stay in their float32 (or float64): a 16-bit row is multiplied in that precision and rounded once, as a
    scale given as a Python number would be."""
    local = local_tensor(tensor)
    if local.numel() == 0:
        return
    rows = local_indices(tensor, 0)
    scales = row_scales if rows is None else row_scales[rows]
    local.mul_(scales.view(-1, *([1] * (local.ndim - 1))))
