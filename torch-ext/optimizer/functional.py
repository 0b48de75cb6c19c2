"""The single-device update math, on plain tensors: Muon for matrices, torch's fused AdamW formula for the rest.

Neither function syncs with the host: a parameter whose gradient is not finite is detected on the device (by the
momentum op for Muon; for AdamW by the caller's `found_inf` flags, since deciding that for a DTensor gradient takes
its ranks, or for plain gradients here, on the CPU inside the update op) and its update is masked to an exact no-op
(parameter and optimizer state unchanged), and its skip counter is incremented. Nothing here imports the distributed
layer.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import repeat
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor

from . import native
from .launch_plans import launch_plan
from .newton_schulz import Orthogonalizer, staging_dtype
from .normalization import normalize, rms_rule_scales, uses_rms_rule
from .option_values import overflowed_to_infinity
from .routing import MatrixView
from .state_precision import EntryPositions, advance_counts_
from .triton_kernels import (TRITON_AVAILABLE, apply_takes, launch_adamw_, launch_apply_, launch_counts_,
                             launch_nonfinite_, launchable, launchable_rounded, tabulate, tabulate_rounded)
from .workspace import Workspace

if TYPE_CHECKING:
    from .triton_kernels.adamw import Tabulated

T = TypeVar("T")

ADJUST_LR_FNS: tuple[str, ...] = ("original", "match_rms_adamw", "spectral", "rsqrt_in")

# A tensor lr stays a tensor through the update, so that a compiled step never reads its value.
LearningRate = float | Tensor

# Devices whose AdamW parameters go through the Triton kernel that takes a skip flag per tensor in one launch (on
# others, torch's fused kernel per parameter, or on the CPU once per dtype after reading the flags).
ONE_LAUNCH_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
# Small buckets share a round of `muon_update` (see `_rounds`) up to this many elements of stacks in all (8 MiB in
# float32), so that the memory their stacks and Newton-Schulz results hold at once stays small. On the MNIST MLP
# 784-256-256-10 (three buckets of one matrix each) one round instead of three took 0.21-0.29 ms off a ~7 ms step
# (from 1.13x-1.15x torch.optim.Muon's time to 1.09x-1.11x, paired; 2-core AMD EPYC).
_ROUND_NUMEL = 2**21
# A bucket's stack and its Newton-Schulz buffers (about three times the stack) are the step's largest temporaries, and
# a bucket of every same-shape matrix grows with the model's depth (Llama-3-8B's 32 MLP matrices of 4096 x 14336 would
# hold ~12 GB in bfloat16): past this many elements, by device type, a bucket is split into near-equal chunks (see
# `_chunks`). Not much further on CPUs: there a batch of one or two mid-sized matrices ran its products at up to half
# the rate of a batch of six (768 x 3072 bf16 X Xᵀ, oneDNN on a 2-core Xeon: 3.95, 1.95 and 1.62 ms per matrix), and
# GPT-2 small's step in chunks of one to two of its 768 x 3072 matrices took 1.18x the time of whole buckets of 12, in
# chunks of six 0.92x (paired). On GPUs, where each chunk's launches cost host time, GPT-2 small's buckets stay whole.
_BUCKET_NUMEL = {"cpu": 2**24}
_GPU_BUCKET_NUMEL = 2**25
# Device types where that kernel failed to build or launch (a Triton that cannot compile it for this GPU): their AdamW
# goes through torch's fused kernel for the rest of the process.
_one_launch_failed: set[str] = set()


def adjusted_lr(lr: LearningRate, adjust_lr_fn: str | None, view: MatrixView,
                normalize_spatial: bool = False) -> LearningRate:
    """Scales lr for a parameter's (rows=out, cols=in) matrices so updates of different shapes have comparable size;
    with `normalize_spatial`, a conv weight orthogonalized per kernel position ("batched") also gets
    1 / sqrt(positions), as timm does."""
    if normalize_spatial and view.spatial_batched:
        lr = lr / math.sqrt(view.batch)
    rows, cols = view.rows, view.cols
    if adjust_lr_fn == "original":  # Keller Jordan's Muon
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":  # Moonshot: update RMS matches AdamW's, so AdamW's lr and wd carry over
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn == "spectral":  # sqrt(fan_out / fan_in), the spectral-norm scaling (timm: "rms_to_rms")
        return lr * math.sqrt(rows / cols)
    if adjust_lr_fn == "rsqrt_in":  # 1 / sqrt(fan_in), timm's
        return lr / math.sqrt(cols)
    return lr


def update_step_size(lr: LearningRate, adjust_lr_fn: str | None, view: MatrixView, normalize_spatial: bool,
                     rms_scale: Tensor | None) -> LearningRate:
    """What a parameter's orthogonalized (and maybe normalized) update is multiplied by: lr scaled for its shape or,
    under the RMS rule of a normalization, lr times `rms_scale`, which gives the update RMS 0.2 (adjust_lr_fn's own
    scaling is then moot)."""
    if rms_scale is None:
        return adjusted_lr(lr, adjust_lr_fn, view, normalize_spatial)
    return adjusted_lr(lr, None, view, normalize_spatial) * rms_scale


def decay_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of decoupled weight decay's factors for parameters of `param_dtype`: float32, or float64 for float64
    parameters (a float32 factor would round their decay by ~3e-8). Never a 16-bit one: bfloat16 rounds 1 - 0.002 to
    1 - 0.0039, which doubled a bfloat16 matrix's decay, and 1 - 0.0005 to 1 (no decay at all); torch.optim.Muon
    multiplies by the factor as a float32 number."""
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def decay_factors(skipped: Tensor, lr: LearningRate, weight_decay: float, param_dtype: torch.dtype) -> Tensor:
    """Decoupled weight decay's factor per parameter: 1 - lr * weight_decay, or 1 where the step was skipped, in
    `decay_dtype` (a tensor lr taken to it first). Filled on the device, not copied from the host, so a GPU step gains
    no transfer."""
    dtype = decay_dtype(param_dtype)
    if isinstance(lr, Tensor):
        factors = (1.0 - lr.to(dtype=dtype, device=skipped.device) * weight_decay).expand(skipped.shape)
    else:
        factors = torch.full(skipped.shape, overflowed_to_infinity(1.0 - lr * weight_decay, dtype), dtype=dtype,
                             device=skipped.device)
    return factors.masked_fill(skipped, 1.0)


@dataclass
class MuonTensors:
    """One Muon parameter with what its update needs."""

    param: Tensor
    grad: Tensor
    momentum_buffer: Tensor
    nonfinite_skips: Tensor
    view: MatrixView
    # With a `normalization`: the second moment of the orthogonalized update (see `moment_dtype`) and its step count.
    second_moment: Tensor | None = None
    update_step: Tensor | None = None
    # With a `state_dtype`: the count of stochastically rounded writes of the momentum (see `state_precision`), and
    # with "int8" the momentum's block scales.
    rounding_count: Tensor | None = None
    momentum_scales: Tensor | None = None
    # A shard's entries' indices in the whole tensor, which the rounding draws on (None: the tensor is whole).
    rounding_positions: EntryPositions | None = None


def momentum_step_(buffers: Sequence[Tensor], grads: Sequence[Tensor], outputs: Sequence[Tensor], beta: float,
                   nesterov: bool, rounding_counts: Sequence[Tensor | None], scales: Sequence[Tensor | None],
                   positions: Sequence[EntryPositions | None], agreed: Tensor | None = None) -> Tensor:
    """The momentum op for each buffer: `native.muon_momentum_`, or `native.muon_momentum_rounded_` for one with a
    rounding count (a `state_dtype`; with "int8", its block scales too). Returns the finite flags (float32 0.0/1.0),
    times `agreed` where given (the flags of the other ranks holding the same matrices, whose callers have already
    made a gradient that is not finite elsewhere not finite here); a count moves only where the final flag is 1."""
    rounded = [i for i, count in enumerate(rounding_counts) if count is not None]
    plain = [i for i, count in enumerate(rounding_counts) if count is None]
    parts: list[tuple[list[int], Tensor]] = []
    if plain:
        parts.append((plain, native.muon_momentum_([buffers[i] for i in plain], [grads[i] for i in plain],
                                                   [outputs[i] for i in plain], beta, nesterov)))
    if rounded:
        parts.append((rounded, native.muon_momentum_rounded_(
            [buffers[i] for i in rounded], [scales[i] for i in rounded], [grads[i] for i in rounded],
            [outputs[i] for i in rounded], [rounding_counts[i] for i in rounded],
            [positions[i] for i in rounded], beta, nesterov)))
    finite = parts[0][1] if len(parts) == 1 else _merged(parts, len(buffers))
    if agreed is not None:
        finite = finite * agreed  # products of 0.0 and 1.0: exact
    if rounded:
        advance_counts_([rounding_counts[i] for i in rounded], picked(finite, rounded))
    return finite


def picked(values: Tensor, indices: Sequence[int]) -> Tensor:
    """values[indices], to be read only, without an index tensor: torch copies a list index to a GPU from pageable
    memory, which synchronizes the host with the device. Consecutive indices are a slice of `values` (no operator
    call); others are views stacked in one kernel."""
    indices = list(indices)
    start = indices[0] if indices else 0
    if indices == list(range(start, start + len(indices))):
        return values[start:start + len(indices)]
    return torch.stack([values[i] for i in indices])


def _merged(parts: Sequence[tuple[list[int], Tensor]], total: int) -> Tensor:
    """One (total,) tensor of the flags each part computed for its indices (stacked from views, as in `picked`)."""
    entries: list[Tensor | None] = [None] * total
    for indices, flags in parts:
        for index, flag in zip(indices, flags.unbind()):
            entries[index] = flag
    return torch.stack(entries)


def buckets(items: Sequence[MuonTensors]) -> list[list[MuonTensors]]:
    """The items as `muon_update` orthogonalizes them: one batched call per bucket of same-shape matrices, or per
    chunk of a large one (`_chunks`)."""
    return [chunk for bucket in _bucket(items).values() for chunk in _chunks(bucket)]


def _bucket(items: Sequence[MuonTensors]) -> dict[tuple, list[MuonTensors]]:
    """Parameters whose matrices share shape, device and dtype are orthogonalized in one batched call."""
    buckets: dict[tuple, list[MuonTensors]] = {}
    for item in items:
        key = (item.param.device, item.param.dtype, item.view.rows, item.view.cols)
        buckets.setdefault(key, []).append(item)
    return buckets


def _chunks(bucket: list[MuonTensors]) -> list[list[MuonTensors]]:
    """A bucket as the fewest near-equal runs of consecutive items whose stacks hold at most _BUCKET_NUMEL elements
    each; an item of more matrices than a run holds (an expert bank) stays whole, in the run its first matrix falls
    in."""
    batch, rows, cols = _stack_shape(bucket)
    per_run = max(1, _BUCKET_NUMEL.get(bucket[0].param.device.type, _GPU_BUCKET_NUMEL) // (rows * cols))
    runs = math.ceil(batch / per_run)
    if runs == 1:
        return [bucket]
    chunks: list[list[MuonTensors]] = [[] for _ in range(runs)]
    start = 0
    for item in bucket:
        chunks[start * runs // batch].append(item)
        start += item.view.batch
    return [chunk for chunk in chunks if chunk]


def _rounds(buckets: Sequence[list[MuonTensors]]) -> list[list[list[MuonTensors]]]:
    """The buckets as `muon_update` applies them. Buckets of one device and dtype share a round while their stacks hold
    at most _ROUND_NUMEL elements in all (a larger bucket is a round of its own), and in a round the momentum op, the
    skip counters, the decay factors and the update each take one call for all of its parameters."""
    rounds: list[list[list[MuonTensors]]] = []
    filling: dict[tuple, tuple[list[list[MuonTensors]], int]] = {}
    for bucket in buckets:
        numel = math.prod(_stack_shape(bucket))
        key = (bucket[0].param.device, bucket[0].param.dtype)
        current, held = filling.get(key, (None, 0))
        if current is None or held + numel > _ROUND_NUMEL:
            current, held = [], 0
            rounds.append(current)
        current.append(bucket)
        filling[key] = (current, held + numel)
    return rounds


def _stack_shape(bucket: Sequence[MuonTensors]) -> tuple[int, int, int]:
    """(batch, rows, cols) of the stack the bucket's matrices are orthogonalized in."""
    return sum(item.view.batch for item in bucket), bucket[0].view.rows, bucket[0].view.cols


def _momentum_into(buckets: Sequence[list[MuonTensors]], stacks: Sequence[Tensor], beta: float,
                   nesterov: bool) -> Tensor:
    """Momentum step for the buckets' items in one call, writing each update straight into its slice of its bucket's
    (batch, rows, cols) stack; the finite flags in the items' order.

    A tall bucket's stack stays in the parameters' layout, so Newton-Schulz's first step reads it transposed. Storing
    it as its wide transpose instead (the momentum op writing 64 x 64 tiles through register transposes) made that
    step's bf16 products ~45 ms faster on GPT-2 small, but the transposing writes took twice the op's straight pass
    even with the next tile prefetched, and the step gained nothing measurable (paired, 2-core Xeon)."""
    items = [item for bucket in buckets for item in bucket]
    outputs: list[Tensor] = []
    scattered: list[tuple[Tensor, Tensor, MatrixView]] = []
    for bucket, matrices in zip(buckets, stacks):
        offset = 0
        for item in bucket:
            target = matrices if len(bucket) == 1 else matrices[offset:offset + item.view.batch]
            offset += item.view.batch
            if not item.view.is_reshape:  # not a view of the stack: fill a temporary, then permute it in
                temp = torch.empty(item.param.shape, dtype=matrices.dtype, device=matrices.device)
                scattered.append((target, temp, item.view))
                outputs.append(temp)
            else:
                outputs.append(target.view(item.param.shape))
    finite = momentum_step_([item.momentum_buffer for item in items], [item.grad.contiguous() for item in items],
                            outputs, beta, nesterov, [item.rounding_count for item in items],
                            [item.momentum_scales for item in items], [item.rounding_positions for item in items])
    for target, temp, view in scattered:
        target.copy_(view.to_matrices(temp))
    return finite


def _stacks(buckets: Sequence[list[MuonTensors]], workspace: Workspace, orthogonalizer: Orthogonalizer,
            device: torch.device) -> list[Tensor]:
    """Each bucket's (batch, rows, cols) stack in the dtype its iteration is staged in, those of a dtype one after the
    other in the workspace's block for it."""
    shapes = [_stack_shape(bucket) for bucket in buckets]
    dtypes = [staging_dtype(orthogonalizer.stack_dtype(shape, device), bucket[0].param.dtype)
              for shape, bucket in zip(shapes, buckets)]
    stacks: list[Tensor] = [None] * len(buckets)  # type: ignore[list-item] (each filled below)
    for dtype in dict.fromkeys(dtypes):
        members = [index for index, other in enumerate(dtypes) if other == dtype]
        if len(members) == 1:  # the block at its shape: no split, no view (a lone matrix's step is host-bound)
            stacks[members[0]] = workspace.tensor(f"stack {dtype}", shapes[members[0]], dtype, device)
            continue
        sizes = [math.prod(shapes[index]) for index in members]
        block = workspace.tensor(f"stack {dtype}", (sum(sizes),), dtype, device)
        for index, part in zip(members, block.split(sizes)):
            stacks[index] = part.view(shapes[index])
    return stacks


def muon_update(items: Sequence[MuonTensors], *, lr: LearningRate | Sequence[float],
                weight_decay: float | Sequence[float], momentum: float, nesterov: bool, orthogonalizer: Orthogonalizer,
                adjust_lr_fn: str | None, normalize_spatial: bool, normalization: str | None, normalization_beta: float,
                workspace: Workspace | None = None) -> None:
    """Momentum, batched Newton-Schulz per bucket, the optional second-moment normalization, decoupled weight decay
    and the scaled update, round by round (see `_rounds`). A round's stacks come from `workspace` (None: a fresh one),
    and so do the Newton-Schulz buffers of a round of one bucket; in a round of several, each bucket's Newton-Schulz
    allocates its own small buffers, whose results stay alive until the round's update.

    `lr` and `weight_decay`: one for all items, or numbers, one per item in items' order, so that parameter groups
    which differ only in them (layer-wise lr decay: a group per block) share buckets and rounds."""
    workspace = workspace or Workspace()
    rates = Rates(items, lr, weight_decay)
    for round_buckets in _rounds(buckets(items)):
        round_items = [item for bucket in round_buckets for item in bucket]
        round_lrs = rates.of(round_items)[0]
        device = round_items[0].param.device
        stacks = _stacks(round_buckets, workspace, orthogonalizer, device)
        finite = _momentum_into(round_buckets, stacks, momentum, nesterov)
        # A skipped parameter's momentum step wrote zeros, and Newton-Schulz maps zero to exactly zero (the norm is
        # clamped, and each matrix of the batch is independent), so its update below adds exactly nothing.
        ns_workspace = workspace if len(round_buckets) == 1 else None
        updates: list[Tensor] = []
        for bucket, matrices in zip(round_buckets, stacks):
            orthogonal = orthogonalizer(matrices, ns_workspace)
            parts = orthogonal.split([item.view.batch for item in bucket]) if len(bucket) > 1 else (orthogonal,)
            updates += [item.view.from_matrices(part, item.param.shape) for item, part in zip(bucket, parts)]
        params = [item.param for item in round_items]
        skipped = finite.eq(0)
        torch._foreach_add_([item.nonfinite_skips for item in round_items], skipped.to(torch.int64).unbind())
        rms_rule = uses_rms_rule(normalization, adjust_lr_fn)
        totals = None
        if normalization is not None:
            updates, totals = normalize(updates, None, [item.second_moment for item in round_items],
                                        [item.update_step for item in round_items], skipped,
                                        [item.view for item in round_items], normalization, normalization_beta,
                                        orthogonalizer.eps, bias_correction=not rms_rule, sums_of_squares=rms_rule)
        step_sizes = _negated_step_sizes(round_items, round_lrs, adjust_lr_fn, normalize_spatial, totals,
                                         orthogonalizer.eps)
        _apply_update_(params, updates, _round_decay(skipped, rates, round_items, params[0].dtype), step_sizes)


def _negated_step_sizes(items: Sequence[MuonTensors], lrs: Sequence[LearningRate], adjust_lr_fn: str | None,
                        normalize_spatial: bool, totals: Tensor | None, eps: float) -> list[LearningRate]:
    """Each item's `update_step_size`, negated (the update is added), where `totals` (None: no RMS rule) holds each
    update's ‖U‖². Under the RMS rule with number lrs, the lrs multiply the scales in one launch for all, the sign
    with them (exact: a product's rounding is symmetric), where a product and a negation per item took two launches
    each on a GPU."""
    if totals is None:
        return [-update_step_size(lr, adjust_lr_fn, item.view, normalize_spatial, None) for item, lr in zip(items, lrs)]
    scales = rms_rule_scales(totals, [item.view for item in items], eps)
    factors = [adjusted_lr(lr, None, item.view, normalize_spatial) for item, lr in zip(items, lrs)]
    if any(isinstance(factor, Tensor) for factor in factors):
        return [-(factor * scale) for factor, scale in zip(factors, scales)]
    torch._foreach_mul_(scales, [-factor for factor in factors])
    return scales


class Rates:
    """Each item's lr and weight decay, from an update's `lr` and `weight_decay`: one for all, or numbers one per
    item in items' order (param groups that differ only in them share one update)."""

    def __init__(self, items: Sequence[MuonTensors | AdamWTensors], lr: LearningRate | Sequence[float],
                 weight_decay: float | Sequence[float]) -> None:
        given = [isinstance(value, Sequence) for value in (lr, weight_decay)]
        for per_item, value in zip(given, (lr, weight_decay)):
            if per_item and len(value) != len(items):
                raise ValueError(f"{len(value)} learning rates or weight decays given for {len(items)} parameters")
        self._common = None if any(given) else (lr, weight_decay)
        self._by_item = {} if self._common is not None else {
            id(item): rate for item, rate in zip(items, zip(lr if given[0] else repeat(lr),
                                                            weight_decay if given[1] else repeat(weight_decay)))}

    def uniform(self, some: Sequence[MuonTensors | AdamWTensors]) -> tuple[LearningRate, float] | None:
        """The one lr and weight decay of these items, where they share one (as the items of one group do)."""
        if self._common is not None:
            return self._common
        first = self._by_item[id(some[0])]
        return first if all(self._by_item[id(item)] == first for item in some) else None

    def of(self, some: Sequence[MuonTensors | AdamWTensors]) -> tuple[list[LearningRate], list[float]]:
        """The lrs and the weight decays of some of the items, in their order."""
        if self._common is not None:
            return [self._common[0]] * len(some), [self._common[1]] * len(some)
        rates = [self._by_item[id(item)] for item in some]
        return [rate[0] for rate in rates], [rate[1] for rate in rates]

    def settings_for(self, some: Sequence[MuonTensors | AdamWTensors], settings: dict[str, Any]) -> dict[str, Any]:
        """An update's `settings` with the lr and weight decay of some of the items (as they are where one of each
        is for all)."""
        if self._common is not None:
            return settings
        lrs, decays = self.of(some)
        return {**settings, "lr": lrs, "weight_decay": decays}


def _round_decay(skipped: Tensor, rates: Rates, items: Sequence[MuonTensors], dtype: torch.dtype) -> Tensor | None:
    """The round's decay factors (`decay_factors`), or None where no parameter of it decays."""
    uniform = rates.uniform(items)
    if uniform is not None:
        return decay_factors(skipped, *uniform, dtype) if uniform[1] != 0 else None
    lrs, weight_decays = rates.of(items)
    if not any(weight_decays):
        return None
    factors = [1.0 - item_lr * decay for item_lr, decay in zip(lrs, weight_decays)]
    return _on_device(factors, decay_dtype(dtype), skipped.device).masked_fill(skipped, 1.0)


def _on_device(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A vector of numbers on `device` without a host sync: a GPU gets it from pinned host memory asynchronously
    (torch syncs a copy from pageable memory); in a compiled step it is a constant of the graph."""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=dtype, device=device)
    vector = torch.tensor(values, dtype=dtype, device="cpu", pin_memory=device.type == "cuda")
    return vector.to(device, non_blocking=True)


def _apply_update_(params: Sequence[Tensor], updates: Sequence[Tensor], decay: Tensor | None,
                   step_sizes: Sequence[float | Tensor]) -> None:
    """`native.apply_update_`, but on GPUs with Triton (outside torch.compile, which traces torch's ops) the matrices
    `apply_takes` takes go in one launch per parameter dtype, update dtype and orientation (two kernels per parameter
    through torch's ops cost GPT-2 small's 48 matrices ~100 operator calls a step). Step sizes all numbers, or all
    tensors on the device (a tensor lr, a normalization's RMS rule), which go to the launch as one float32 vector."""
    device = params[0].device
    on_device = [isinstance(size, Tensor) for size in step_sizes]
    mixed = any(on_device) and not all(on_device)
    # is_compiling first: the tracer folds it to True and reads nothing after it (one_launch_serves asks the CUDA
    # runtime whether a graph is being captured).
    if torch.compiler.is_compiling() or not one_launch_serves(device.type) or mixed:
        native.apply_update_(params, updates, decay, step_sizes)
        return
    sizes = step_sizes
    if any(on_device):
        sizes = torch.stack([size.reshape(()) for size in step_sizes]).to(device, torch.float32)
    groups: dict[tuple[torch.dtype, torch.dtype, bool], list[int]] = {}
    rest = []
    for index, (param, update) in enumerate(zip(params, updates)):
        if apply_takes(param, update):
            groups.setdefault((param.dtype, update.dtype, update.is_contiguous()), []).append(index)
        else:
            rest.append(index)
    pending = list(groups.values())
    for done, indices in enumerate(pending):
        try:
            launch_apply_(params, updates, decay, sizes, indices)
        except Exception as error:  # noqa: BLE001 (whatever Triton raises for a kernel it cannot build here)
            _one_launch_fails(error, device)
            rest += _joined(pending[done:])
            break
    if rest:
        native.apply_update_([params[i] for i in rest], [updates[i] for i in rest],
                             None if decay is None else picked(decay, rest), [step_sizes[i] for i in rest])


@dataclass
class AdamWTensors:
    """One AdamW parameter with its state."""

    param: Tensor
    grad: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    step: Tensor
    nonfinite_skips: Tensor
    # With a `state_dtype`: the moments are stored stochastically rounded; with "int8", as codes and block scales.
    rounding_count: Tensor | None = None
    exp_avg_scales: Tensor | None = None
    exp_avg_sq_scales: Tensor | None = None
    rounding_positions: EntryPositions | None = None  # as MuonTensors'

    @property
    def position_rows(self) -> Tensor | None:
        """The tensor that stands for the positions where a launch plan keeps an item's tensors."""
        return None if self.rounding_positions is None else self.rounding_positions.rows


def adamw_update(items: Sequence[AdamWTensors], found_inf: Tensor | None, *, lr: LearningRate | Sequence[float],
                 betas: tuple[float, float], eps: float, weight_decay: float | Sequence[float]) -> None:
    """AdamW with a skip flag per parameter: found_inf is (N,) float32 on the items' device, 1.0 where that
    parameter's step is skipped; None: no gradient was checked yet, and each is checked here (plain tensors only: a
    DTensor's flag takes its ranks). On GPUs, with Triton, one launch per dtype and stored form for all parameters
    whose tensors are contiguous (`_adamw_one_launch_`, which also checks their gradients and moves their counts on
    the device); torch's fused kernel for the rest, one call per parameter, each with its flag (no host read); on
    the CPU the flags are read (`_adamw_cpu_`).

    The kernel is called directly: `torch.optim.adamw.adamw`'s grouping and checks cost ~25 µs per call, more than the
    kernel itself on a bias vector, and here each call holds one tensor of known device and dtype. What that wrapper
    adds around the kernel is done here: the step count moves by 1 - found_inf, and a tensor lr goes to the device.

    `lr` and `weight_decay`: one for all, or numbers one per parameter (param groups that differ only in them share
    one update)."""
    if found_inf is not None and found_inf.shape != (len(items),):
        raise ValueError(f"found_inf has shape {tuple(found_inf.shape)} for {len(items)} parameters")
    if not items:
        return
    device = items[0].param.device
    rates = Rates(items, lr.to(device) if isinstance(lr, Tensor) else lr, weight_decay)
    if device.type == "cpu" and not one_launch_serves(device.type):
        _adamw_cpu_(items, found_inf, rates, betas=betas, eps=eps)
        return
    left = (_adamw_one_launch_(items, found_inf, rates, betas=betas, eps=eps) if one_launch_serves(device.type)
            else range(len(items)))
    if not left:
        return
    rest = [items[index] for index in left]
    if found_inf is None:
        flags = nonfinite_flags([item.grad for item in rest])
    else:
        flags = picked(found_inf, left)
    _count_steps_(rest, flags)
    for item, flag in zip(rest, flags.unbind()):
        _fused_adamw_one_(item, flag, *rates.uniform([item]), betas=betas, eps=eps)


def _count_steps_(items: Sequence[AdamWTensors], skipped: Tensor) -> None:
    """Each parameter's step count moves by 1 - flag and its skip count by its flag, in two foreach calls (an op per
    parameter costs more than a bias's update)."""
    torch._foreach_add_([item.step for item in items], (1 - skipped).unbind())
    torch._foreach_add_([item.nonfinite_skips for item in items], skipped.to(torch.int64).unbind())


def one_launch_serves(device_type: str) -> bool:
    """Whether the one-launch Triton kernels (the AdamW part, the Muon update) serve this device type now: not after
    one failed there, nor while a CUDA graph is being captured, whose replays would copy the kernels' tables again
    from a host buffer freed long before (torch's kernels, one call per parameter, capture cleanly)."""
    if not TRITON_AVAILABLE or device_type not in ONE_LAUNCH_DEVICE_TYPES or device_type in _one_launch_failed:
        return False
    return device_type != "cuda" or not torch.cuda.is_current_stream_capturing()


def _adamw_one_launch_(items: Sequence[AdamWTensors], found_inf: Tensor | None, rates: Rates, *,
                       betas: tuple[float, float], eps: float) -> list[int]:
    """The parameters the Triton kernels take, in one launch per dtype and stored form of their moments, each with its
    skip flag (found_inf's, or where None, its gradient checked by a launch before): those `_fits_one_launch` takes,
    and those whose moments are stored rounded that `_fits_rounded_launch` takes (decided once and kept while the
    tensors stay: `launch_plans`); a launch after moves their step, skip and rounding counts by the flags. Returns the
    indices of the others. Where a kernel fails to build or launch before the update is written, says so once and
    returns the indices it had not done, for torch's fused kernel, now and at every later step."""
    plan = launch_plan(items, _addressed, _launch_groups)
    for done, group in enumerate(plan.groups):
        tabulated = group.tabulated_for(items)
        try:
            skipped = launch_nonfinite_(tabulated) if found_inf is None else picked(found_inf, group.indices)
            launch_adamw_(tabulated, skipped, betas=betas, eps=eps, **_launch_rates(rates, group.indices, items))
        except ValueError:
            raise
        except Exception as error:  # noqa: BLE001 (whatever Triton raises for a kernel it cannot build here)
            _one_launch_fails(error, items[0].param.device)
            return plan.left + _joined([pending.indices for pending in plan.groups[done:]])
        try:
            launch_counts_(tabulated, skipped)
        except Exception as error:  # noqa: BLE001 (as above; the update is written, so its counts move by torch's ops)
            _one_launch_fails(error, items[0].param.device)
            taken = [items[i] for i in group.indices]
            _count_steps_(taken, skipped)
            if group.stored is not None:
                advance_counts_([item.rounding_count for item in taken], 1.0 - skipped)
            return plan.left + _joined([pending.indices for pending in plan.groups[done + 1:]])
    return plan.left


def _launch_rates(rates: Rates, indices: Sequence[int], items: Sequence[AdamWTensors]) -> dict[str, Any]:
    """A launch's lr and weight decay: one for all its tensors, or where they differ (groups sharing the launch), a
    (lr, weight decay) pair per tensor in float64 on the device, copied there without a host sync."""
    taken = [items[index] for index in indices]
    uniform = rates.uniform(taken)
    if uniform is not None:
        return dict(lr=uniform[0], weight_decay=uniform[1])
    lrs, weight_decays = rates.of(taken)
    pairs = [rate for pair in zip(lrs, weight_decays) for rate in pair]
    return dict(lr=0.0, weight_decay=0.0, rates=_on_device(pairs, torch.float64, taken[0].param.device))


@dataclass(frozen=True)
class _LaunchGroup:
    """The parameters of one launch: their dtype's, and their moments' stored form (None: as they are), with their
    tables, kept without the tensors their units count from (a kept plan holds no tensor)."""

    stored: torch.dtype | None
    indices: list[int]
    tables: Tabulated

    def tabulated_for(self, items: Sequence[AdamWTensors]) -> Tabulated:
        first = items[self.indices[0]]
        return replace(self.tables, like=first.param, moment_like=None if self.stored is None else first.exp_avg)


def _launch_groups(items: Sequence[AdamWTensors]) -> tuple[list[_LaunchGroup], list[int]]:
    """The one-launch groups of `_adamw_one_launch_`, with their tables, and the indices of the items they leave."""
    groups: dict[tuple[torch.dtype, torch.dtype | None], list[int]] = {}
    left = []
    for index, item in enumerate(items):
        if _fits_one_launch(item):
            groups.setdefault((item.param.dtype, None), []).append(index)
        elif _fits_rounded_launch(item):
            groups.setdefault((item.param.dtype, item.exp_avg.dtype), []).append(index)
        else:
            left.append(index)
    launches = []
    for (_, stored), indices in groups.items():
        group = [items[i] for i in indices]
        skip_counts = [item.nonfinite_skips for item in group]
        if stored is None:
            tabulated = tabulate([(item.param, item.grad, item.exp_avg, item.exp_avg_sq, item.step) for item in group],
                                 skip_counts)
        else:
            tabulated = tabulate_rounded([(item.param, item.grad, item.exp_avg, item.exp_avg_sq, item.step,
                                           item.rounding_count, item.exp_avg_scales, item.exp_avg_sq_scales,
                                           item.rounding_positions) for item in group], skip_counts)
        launches.append(_LaunchGroup(stored, indices, replace(tabulated, like=None, moment_like=None)))
    return launches, left


# What an item's launch group depends on besides its gradient: the tensors its table row holds, and the positions that
# keep a shard out of the rounded launch (a getter of C, but for the positions' property: a plan's check asks it of
# every item given anew).
_addressed: Callable[[AdamWTensors], tuple[Tensor | None, ...]] = operator.attrgetter(
    "param", "exp_avg", "exp_avg_sq", "step", "nonfinite_skips", "rounding_count", "exp_avg_scales",
    "exp_avg_sq_scales", "position_rows")


def _joined(groups: Sequence[list[int]]) -> list[int]:
    """The indices of the launch groups not done, for torch's kernels."""
    return [index for group in groups for index in group]


def _one_launch_fails(error: Exception, device: torch.device) -> None:
    """Says once that a Triton kernel of the step failed on this device type, whose AdamW part and Muon update take
    torch's kernels from now on."""
    _one_launch_failed.add(device.type)
    warnings.warn(f"a one-launch Triton kernel of the step failed on {device} ({error!r}); the AdamW part (torch's "
                  "fused AdamW kernel, one call per parameter) and the Muon update go through torch's kernels from now "
                  "on", RuntimeWarning, stacklevel=3)


def _fits_one_launch(item: AdamWTensors) -> bool:
    """Whether the one-launch kernel takes this parameter: moments stored as they are, and what `launchable` asks."""
    return item.rounding_count is None and launchable(item.param, item.grad, item.exp_avg, item.exp_avg_sq, item.step)


def _fits_rounded_launch(item: AdamWTensors) -> bool:
    """Whether the rounded one-launch kernel takes this parameter: moments stored rounded, and what
    `launchable_rounded` asks."""
    return (item.rounding_count is not None
            and launchable_rounded(item.param, item.grad, item.exp_avg, item.exp_avg_sq, item.step,
                                   item.rounding_count, item.exp_avg_scales, item.exp_avg_sq_scales))


def nonfinite_flags(grads: Sequence[Tensor]) -> Tensor:
    """(N,) float32 on the gradients' device: 1.0 where a plain tensor holds a NaN or Inf, else 0.0; no host sync."""
    return 1.0 - native.finite_flags(grads)


def _adamw_cpu_(items: Sequence[AdamWTensors], found_inf: Tensor | None, rates: Rates, *,
                betas: tuple[float, float], eps: float) -> None:
    """The CPU's AdamW part, whose flags are read for free. float32 and bfloat16 parameters whose moments are stored as
    they are go through the compiled `adamw_checked_` in one call, each gradient (where found_inf is None) checked just
    before its own update: a check of every gradient first read the embedding's back from memory a whole pass ahead of
    its update (GPT-2 small's 97 AdamW tensors: 1.21x fused AdamW's time that way, 1.06x-1.10x in one call, 2-core
    Xeon). The rest (moments stored rounded, float16 and float64 parameters, builds without the op) after one check of
    their gradients: stored rounded, each through `_fused_adamw_one_`; else through torch's fused kernel, once per
    dtype and rate."""
    compiled = native.has_compiled_adamw_checked("cpu")
    takes = [compiled and _adamw_checked_takes(item) for item in items]
    checked = [i for i, taken in enumerate(takes) if taken]
    rest = [i for i, taken in enumerate(takes) if not taken]
    if checked:
        taken = [items[i] for i in checked]
        known = None if found_inf is None else found_inf[checked]
        lrs, weight_decays = rates.uniform(taken) or rates.of(taken)
        flags = native.adamw_checked_([item.param for item in taken], [item.grad for item in taken],
                                      [item.exp_avg for item in taken], [item.exp_avg_sq for item in taken],
                                      [item.step for item in taken], known, lr=lrs, betas=betas, eps=eps,
                                      weight_decay=weight_decays)
        _count_skips(taken, flags.tolist())
    if rest:
        others = [items[i] for i in rest]
        flags = nonfinite_flags([item.grad for item in others]) if found_inf is None else found_inf[rest]
        skipped = flags.tolist()
        _count_read_steps(others, skipped)
        _fused_adamw_taken_(others, skipped, rates, betas=betas, eps=eps)


def _count_read_steps(items: Sequence[AdamWTensors], skipped: Sequence[float]) -> None:
    """The step counts of the parameters taken and the skip counts of the others (usually none) each moved by 1 in
    one foreach call with a scalar, where the flags are read: no per-parameter operand tensors to make (two unbinds of
    97 views each cost more than GPT-2 small's bias updates)."""
    taken = [item.step for item, skip in zip(items, skipped) if not skip]
    if taken:
        torch._foreach_add_(taken, 1.0)
    _count_skips(items, skipped)


def _count_skips(items: Sequence[AdamWTensors], skipped: Sequence[float]) -> None:
    """The skip counts of the parameters skipped, each moved by 1, where the flags are read."""
    missed = [item.nonfinite_skips for item, skip in zip(items, skipped) if skip]
    if missed:
        torch._foreach_add_(missed, 1)


def _adamw_checked_takes(item: AdamWTensors) -> bool:
    """Whether `adamw_checked_` steps this parameter: float32 or bfloat16, with its moments stored as they are (in
    its dtype) and a float32 step count."""
    return (item.rounding_count is None and item.step.dtype == torch.float32
            and item.param.dtype in native.ADAMW_CHECKED_DTYPES
            and item.exp_avg.dtype == item.exp_avg_sq.dtype == item.param.dtype)


def _fused_adamw_taken_(items: Sequence[AdamWTensors], skipped: Sequence[float], rates: Rates, *,
                        betas: tuple[float, float], eps: float) -> None:
    """On the CPU the flags are read (a CPU tensor's value costs no device sync): the parameters not skipped go
    through one fused call per dtype and rate, the skipped ones are left alone. A call per parameter cost ~30 µs
    each, 3 ms of the 24 ms of GPT-2 small's 97 AdamW tensors on a 2-core Xeon, the call itself longer than a bias's
    update."""
    together: dict[tuple, list[AdamWTensors]] = {}
    for item, skip in zip(items, skipped):
        if skip:
            continue
        rate = rates.uniform([item])
        if item.rounding_count is not None:  # stored rounded: its own call
            _fused_adamw_one_(item, None, *rate, betas=betas, eps=eps)
        else:
            together.setdefault((item.param.dtype, *rate), []).append(item)
    for group in together.values():
        _fused_adamw_plain_(group, None, *rates.uniform(group[:1]), betas=betas, eps=eps)


def by_device(items: Sequence[AdamWTensors]) -> dict[torch.device, list[AdamWTensors]]:
    """The parameters grouped by device, in order: each group's flags live on its device."""
    devices = {item.param.device for item in items}
    if len(devices) == 1:  # the usual case, without a list per item
        return {devices.pop(): list(items)}
    groups: dict[torch.device, list[AdamWTensors]] = {}
    for item in items:
        groups.setdefault(item.param.device, []).append(item)
    return groups


_ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq")
# Entries per float32 working copy of rounded moments: the copies of a 38M-entry embedding would otherwise add 8 bytes
# per entry to the step's peak memory. 2^18 entries (2 MiB for the two moments' copies): the AdamW part of GPT-2
# small's int8-state step took 153 ms in chunks of 2^16, 132 of 2^17, 126 of 2^18 and 125 of 2^19 (2-core Xeon),
# torch's per-call costs (~25 us per op) shrinking with the count of chunks.
ROUNDED_CHUNK = 1 << 18


def _fused_adamw_one_(item: AdamWTensors, found_inf: Tensor | None, lr: LearningRate, weight_decay: float, *,
                      betas: tuple[float, float], eps: float) -> None:
    """One parameter's AdamW step, skipped where found_inf (a float32 flag on its device) is 1.0; None: taken (the
    CPU path, which read the flags first), and then moments stored rounded go through the compiled
    `adamw_rounded_` where the build has it, except a float64 parameter's, which that op would step in float32."""
    settings = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if item.rounding_count is None:
        _fused_adamw_plain_([item], found_inf, lr, weight_decay, betas=betas, eps=eps)
        return
    param = item.param.contiguous()  # see `_fused_adamw_plain_`
    if found_inf is None and param.dtype != torch.float64 and native.has_compiled_adamw_rounded(param.device.type):
        native.adamw_rounded_(param, item.grad.reshape(param.shape), item.exp_avg, item.exp_avg_scales,
                              item.exp_avg_sq, item.exp_avg_sq_scales, item.rounding_count, item.rounding_positions,
                              item.step, **settings)
        advance_counts_([item.rounding_count], torch.ones(1, device=item.rounding_count.device))
    else:
        taken = torch.zeros((), dtype=torch.float32, device=param.device) if found_inf is None else found_inf
        _fused_adamw_rounded_(item, param, taken, **settings)
    if param is not item.param:
        item.param.copy_(param)


def _fused_adamw_plain_(items: Sequence[AdamWTensors], found_inf: Tensor | None, lr: LearningRate,
                        weight_decay: float, *, betas: tuple[float, float], eps: float) -> None:
    """torch's fused AdamW on parameters of one dtype whose moments are stored as they are, in one call."""
    _on_contiguous_(items, lambda params, grads, exp_avgs, exp_avg_sqs: torch._fused_adamw_(
        params, grads, exp_avgs, exp_avg_sqs, [], [item.step for item in items], lr=lr, beta1=betas[0],
        beta2=betas[1], weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, found_inf=found_inf))


def _on_contiguous_(items: Sequence[AdamWTensors],
                    update: Callable[[list[Tensor], list[Tensor], list[Tensor], list[Tensor]], T]) -> T:
    """update(params, grads, exp_avgs, exp_avg_sqs) on contiguous forms of the items' tensors, each gradient in its
    parameter's dtype; returns what update returns. torch's CPU fused AdamW walks every tensor as if it were
    contiguous: on a strided view (a column, a transposed weight) it computes a wrong update and writes beside the
    view; the compiled ops take contiguous tensors. What was a copy goes back."""
    written = [tensor for item in items for tensor in (item.param, item.exp_avg, item.exp_avg_sq)]
    work = [tensor.contiguous() for tensor in written]
    grads = [item.grad if item.grad.dtype == item.param.dtype else item.grad.to(item.param.dtype) for item in items]
    result = update(work[0::3], [grad.contiguous() for grad in grads], work[1::3], work[2::3])
    for original, copy in zip(written, work):
        if copy is not original:
            original.copy_(copy)
    return result


def _fused_adamw_rounded_(item: AdamWTensors, param: Tensor, found_inf: Tensor, *, lr: LearningRate,
                          betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """torch's fused AdamW on float32 working copies of stochastically rounded moments (float64 for a float64
    parameter, which float32 would round at every step; the kernel wants one dtype for all its tensors: the
    parameter and gradient then too), ROUNDED_CHUNK entries at a time, whole blocks of "int8" codes each; `param` is
    contiguous. The count moves once, as the moments' writes are one step."""
    quantized = item.exp_avg_scales is not None
    # (lines, line) views: an "int8" moment's blocks lie along its last dim, so chunks are whole lines of it.
    line = param.shape[-1] if quantized else 1
    lines = [tensor.reshape(-1, line) for tensor in (param, item.grad.reshape(param.shape).contiguous(),
                                                     item.exp_avg, item.exp_avg_sq)]
    scales = [None if scale is None else scale.view(-1, scale.shape[-1])
              for scale in (item.exp_avg_scales, item.exp_avg_sq_scales)]
    taken = 1.0 - found_inf
    rows = max(1, ROUNDED_CHUNK // line)
    work_dtype = torch.promote_types(param.dtype, torch.float32)
    for first in range(0, lines[0].shape[0], rows):
        chunk = slice(first, first + rows)
        chunk_scales = [None if scale is None else scale[chunk] for scale in scales]
        moments = [native.load_moment(key, moment[chunk], scale).to(work_dtype)
                   for key, moment, scale in zip(_ADAMW_MOMENTS, lines[2:], chunk_scales)]
        if quantized:
            # An 8-bit second moment far below its block's largest rounds to 0 now and then, and a first moment
            # that did not would then step by m / eps. In exact arithmetic v is 0 only after gradients of 0, and
            # then m is 0 too: so it is made. v >= 0, so its sign is the mask (a product: a sixth of masked_fill_'s
            # time with its boolean mask).
            moments[0].mul_(moments[1].sign())
        param_chunk = lines[0][chunk]
        work_param = param_chunk.to(work_dtype)
        torch._fused_adamw_([work_param], [lines[1][chunk].to(work_dtype)], moments[:1], moments[1:], [], [item.step],
                            lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay, eps=eps, amsgrad=False,
                            maximize=False, found_inf=found_inf)
        if work_param is not param_chunk:
            param_chunk.copy_(work_param)
        for key, moment, scale, values in zip(_ADAMW_MOMENTS, lines[2:], chunk_scales, moments):
            native.store_moment_(key, moment[chunk], scale, values.float(), item.rounding_count, taken,
                                 item.rounding_positions, first * line)
    advance_counts_([item.rounding_count], taken.reshape(1))
