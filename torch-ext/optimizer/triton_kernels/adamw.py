"""AdamW on many tensors in one launch, each tensor left untouched where its skip flag is set.

The optimizer skips a parameter whose gradient holds a NaN or Inf, and on a GPU it knows which only on the device
(reading the flags would stall the host). torch's fused AdamW takes one `found_inf` for all its tensors, so a flag
per parameter meant one launch per parameter: 97 for GPT-2 small, each costing more host time than a bias's
update. Here a table of addresses (parameter, gradient, moments, step count, size per tensor) and one flag per
tensor go to a single launch whose programs each update one block of one tensor. The same table serves two smaller
launches around it: one that flags the tensors whose gradients hold a NaN or Inf (before), and one that moves each
tensor's step count, skip count and count of rounded writes by its flag (after), where torch's multi-tensor norms
and per-tensor `foreach` additions made about ten operator calls, each allocating a result per tensor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import ALIGNMENT, INTERPRETER, SUPPORTED_DTYPES, device_values
from .rounding import bfloat16_rounded, bfloat16_value, e4m3_block_codes, e4m3_value, random_bits

if TYPE_CHECKING:
    from ..state_precision import EntryPositions

# Elements per program: enough that a program's scalar work (its tensor's row, the bias corrections) is small beside
# the 16-24 bytes per element it streams, few enough that a bias vector does not leave most of a program idle.
BLOCK = 2048

# A row of the address table per tensor, what each of its programs reads before its block: where its parameter,
# gradient, first and second moment start, in 16-byte units from where the first parameter (first moment) starts,
# then its step count's address and its size; with moments stored rounded, also its count of rounded writes' address,
# for 8-bit codes the addresses of its moments' block scales, and for a shard the addresses of its row and column
# positions and its count of columns (state_precision.EntryPositions; 0: a whole tensor); last, its skip count's
# address (0: none kept).
# Starts are in units of ALIGNMENT (see _launch.py), so that the compiler knows them aligned.
_COLUMNS = 7
_ROUNDED_COLUMNS = 13
_NUMEL = 5
# Entries per scale of 8-bit codes, along the last dim (state_precision.BLOCK): a program's BLOCK entries are whole
# blocks of a tensor whose last dim is a multiple of it.
CODE_BLOCK = 256


@triton.jit
def _program_block(table, block_tensor, block_start, skipped, COLUMNS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's tensor (its index and table row), the first entry of its block, and where the tensor's entries
    end for it: at 0 for a skipped tensor, whose programs then touch nothing."""
    block = tl.program_id(0)
    tensor = tl.load(block_tensor + block)
    row = table + tensor * COLUMNS
    end = tl.where(tl.load(skipped + tensor) == 0.0, tl.load(row + 5), 0)
    return tensor, row, tl.multiple_of(tl.load(block_start + block), BLOCK), end


@triton.jit
def _start(like, row, column: tl.constexpr, ELEMENTS_PER_UNIT: tl.constexpr):
    """Where the tensor of the row's `column` starts: that many 16-byte units from `like`."""
    return like + tl.load(row + column) * ELEMENTS_PER_UNIT


@triton.jit
def _step_rule(tensor, row, rates, lr, log2_beta1, log2_beta2, weight_decay, RATES: tl.constexpr):
    """This step's constants for the tensor of the table row: the bias corrections in float64 from the step count
    after this step's increment (the count is read as it was before: `_counts_kernel` moves it after the update), as
    torch's fused kernel takes them (there with pow; here beta^step as exp2(step * log2 beta)); returns (step size,
    decay, sqrt of the second bias correction) for the fp32 arithmetic. RATES: 0, lr and weight_decay as given;
    1, lr the one value at `rates`; 2, this tensor's (lr, weight decay) pair of float64 at `rates`."""
    step = tl.load(tl.load(row + 4).to(tl.pointer_type(tl.float32))).to(tl.float64) + 1.0
    if RATES == 1:
        lr = tl.load(rates).to(tl.float64)
    if RATES == 2:
        lr = tl.load(rates + 2 * tensor)
        weight_decay = tl.load(rates + 2 * tensor + 1)
    bias_correction1 = 1.0 - tl.exp2(step * log2_beta1)
    bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2)).to(tl.float32)
    return tl.cast(lr / bias_correction1, tl.float32), tl.cast(lr * weight_decay, tl.float32), bias_correction2_sqrt


@triton.jit
def _adamw_entries(p, g, m, v, step_size, decay, bias_correction2_sqrt, beta1, beta2, eps):
    """torch.optim.AdamW's arithmetic on float32 entries: returns the new parameter and moments."""
    p = p - decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denominator = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    return p - tl.div_rn(step_size * m, denominator), m, v


@triton.jit
def _nonfinite_blocks_kernel(table, block_tensor, block_start, flags, like, COLUMNS: tl.constexpr,
                             ELEMENTS_PER_UNIT: tl.constexpr, BLOCK: tl.constexpr):
    """flags[t] = 1.0 (from 0.0) for each tensor t whose gradient holds a NaN or Inf: each program reads one block;
    every program that finds one stores the same value, so they need no order among them."""
    block = tl.program_id(0)
    tensor = tl.load(block_tensor + block)
    row = table + tensor * COLUMNS
    offsets = tl.load(block_start + block) + tl.arange(0, BLOCK)
    grad = tl.load(_start(like, row, 1, ELEMENTS_PER_UNIT) + offsets, mask=offsets < tl.load(row + 5),
                   other=0.0).to(tl.float32)
    nonfinite = tl.max(((grad != grad) | (tl.abs(grad) == float("inf"))).to(tl.int32), axis=0)
    tl.store(flags + tensor, 1.0, mask=nonfinite > 0)


@triton.jit
def _counts_kernel(table, skipped, COLUMNS: tl.constexpr, ROUNDED: tl.constexpr, SKIP_COUNTS: tl.constexpr):
    """After the update, each tensor's counts move by its flag: its step count by 1 - flag (float32), with
    SKIP_COUNTS its skip count by flag (int64, the row's last column), with ROUNDED its count of rounded writes by
    1 - flag (int64). One program per tensor."""
    tensor = tl.program_id(0)
    row = table + tensor * COLUMNS
    skip = tl.load(skipped + tensor)
    step = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    tl.store(step, tl.load(step) + (1.0 - skip))
    if SKIP_COUNTS:
        skips = tl.load(row + COLUMNS - 1).to(tl.pointer_type(tl.int64))
        tl.store(skips, tl.load(skips) + skip.to(tl.int64))
    if ROUNDED:
        count = tl.load(row + 6).to(tl.pointer_type(tl.int64))
        tl.store(count, tl.load(count) + (1.0 - skip).to(tl.int64))


@triton.jit
def _adamw_blocks_kernel(
    table, block_tensor, block_start, skipped, like, rates, lr, beta1, beta2, log2_beta1, log2_beta2, eps,
    weight_decay, RATES: tl.constexpr, COLUMNS: tl.constexpr, ELEMENTS_PER_UNIT: tl.constexpr, BLOCK: tl.constexpr
):
    tensor, row, first, end = _program_block(table, block_tensor, block_start, skipped, COLUMNS, BLOCK)
    param, grad = _start(like, row, 0, ELEMENTS_PER_UNIT), _start(like, row, 1, ELEMENTS_PER_UNIT)
    exp_avg, exp_avg_sq = _start(like, row, 2, ELEMENTS_PER_UNIT), _start(like, row, 3, ELEMENTS_PER_UNIT)
    step_size, decay, bias_correction2_sqrt = _step_rule(tensor, row, rates, lr, log2_beta1, log2_beta2,
                                                         weight_decay, RATES)
    offsets = first + tl.arange(0, BLOCK)
    rule = (step_size, decay, bias_correction2_sqrt, beta1, beta2, eps)
    # A whole block unmasked: a mask against a size of unknown divisibility would keep every access to one element.
    if first + BLOCK <= end:
        _adamw_block(param, grad, exp_avg, exp_avg_sq, offsets, None, rule)
    else:
        _adamw_block(param, grad, exp_avg, exp_avg_sq, offsets, offsets < end, rule)


@triton.jit
def _adamw_block(param, grad, exp_avg, exp_avg_sq, offsets, mask, rule):
    """`_adamw_entries` on a block of entries of tensors stored in their parameter's dtype, where `mask` (None: all)."""
    p, m, v = _adamw_entries(tl.load(param + offsets, mask=mask).to(tl.float32),
                             tl.load(grad + offsets, mask=mask).to(tl.float32),
                             tl.load(exp_avg + offsets, mask=mask).to(tl.float32),
                             tl.load(exp_avg_sq + offsets, mask=mask).to(tl.float32), *rule)
    tl.store(param + offsets, p.to(param.dtype.element_ty), mask=mask)
    tl.store(exp_avg + offsets, m.to(param.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq + offsets, v.to(param.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_rounded_blocks_kernel(
    table, block_tensor, block_start, skipped, like, moment_like, rates, lr, beta1, beta2, log2_beta1,
    log2_beta2, eps, weight_decay, RATES: tl.constexpr, CODES: tl.constexpr, COLUMNS: tl.constexpr,
    ELEMENTS_PER_UNIT: tl.constexpr, MOMENT_ELEMENTS_PER_UNIT: tl.constexpr, BLOCK: tl.constexpr,
    CODE_BLOCK: tl.constexpr
):
    """As `_adamw_blocks_kernel`, for moments stored rounded at random: bfloat16 bits (int16), or with CODES, e4m3
    codes (int8) with a float32 scale per CODE_BLOCK entries, the second moment's codes holding its square root, as
    the CPU's `adamw_rounded_` and state_precision.py store them. Both moments round with the same random bits."""
    tensor, row, first, end = _program_block(table, block_tensor, block_start, skipped, COLUMNS, BLOCK)
    param, grad = _start(like, row, 0, ELEMENTS_PER_UNIT), _start(like, row, 1, ELEMENTS_PER_UNIT)
    exp_avg = _start(moment_like, row, 2, MOMENT_ELEMENTS_PER_UNIT)
    exp_avg_sq = _start(moment_like, row, 3, MOMENT_ELEMENTS_PER_UNIT)
    count = tl.load(tl.load(row + 6).to(tl.pointer_type(tl.int64)))
    step_size, decay, bias_correction2_sqrt = _step_rule(tensor, row, rates, lr, log2_beta1, log2_beta2,
                                                         weight_decay, RATES)
    # (code blocks, entries) of this program's BLOCK entries: a code block's scale is one row's.
    rows = tl.arange(0, BLOCK // CODE_BLOCK)
    offsets = first + rows[:, None] * CODE_BLOCK + tl.arange(0, CODE_BLOCK)[None, :]
    if CODES:
        scales = (tl.load(row + 7).to(tl.pointer_type(tl.float32)) + first // CODE_BLOCK + rows,
                  tl.load(row + 8).to(tl.pointer_type(tl.float32)) + first // CODE_BLOCK + rows)
    else:
        scales = (row, row)  # unread
    moments = (exp_avg, exp_avg_sq, scales, count)
    rule = (step_size, decay, bias_correction2_sqrt, beta1, beta2, eps)
    if first + BLOCK <= end:  # see _adamw_blocks_kernel
        _adamw_rounded_block(param, grad, moments, offsets, _positions(row, offsets, None, None), None, None, None,
                             rule, CODES)
    else:
        mask = offsets < end
        _adamw_rounded_block(param, grad, moments, offsets, _positions(row, offsets, mask, 0), mask,
                             first + rows * CODE_BLOCK < end, 0, rule, CODES)


@triton.jit
def _positions(row, offsets, mask, other):
    """Where the row's entries at `offsets` lie in the whole tensor, which their random bits are hashed from: the
    offsets themselves for a whole tensor, else from its row and column positions (see the table's columns), where
    `mask` (None: all)."""
    position_rows = tl.load(row + 9)
    if position_rows == 0:
        positions = offsets
    else:
        column_count = tl.load(row + 11)
        rows = position_rows.to(tl.pointer_type(tl.int64))
        columns = tl.load(row + 10).to(tl.pointer_type(tl.int64))
        positions = (tl.load(rows + offsets // column_count, mask=mask, other=other)
                     + tl.load(columns + offsets % column_count, mask=mask, other=other))
    return positions


@triton.jit
def _adamw_rounded_block(param, grad, moments, offsets, positions, mask, scale_mask, other, rule,
                         CODES: tl.constexpr):
    """`_adamw_entries` on a block of (code blocks, entries) whose moments are stored rounded (see
    `_adamw_rounded_blocks_kernel`) with the random bits of their `positions`, where `mask` (None: all). Entries
    outside it read as 0 (`other`), which leaves their code blocks' largest magnitudes as they are."""
    exp_avg, exp_avg_sq, scales, count = moments
    scale_m, scale_v = scales
    stored_m = tl.load(exp_avg + offsets, mask=mask, other=other)
    stored_v = tl.load(exp_avg_sq + offsets, mask=mask, other=other)
    if CODES:
        root = e4m3_value(stored_v) * tl.load(scale_v, mask=scale_mask, other=other)[:, None]
        v = root * root
        # An 8-bit second moment far below its block's largest rounds to 0 now and then, and a first moment that did
        # not would then step by m / eps; in exact arithmetic v is 0 only after gradients of 0, and then m is too.
        m = tl.where(v == 0.0, 0.0, e4m3_value(stored_m) * tl.load(scale_m, mask=scale_mask, other=other)[:, None])
    else:
        m = bfloat16_value(stored_m)
        v = bfloat16_value(stored_v)
    p, m, v = _adamw_entries(tl.load(param + offsets, mask=mask, other=other).to(tl.float32),
                             tl.load(grad + offsets, mask=mask, other=other).to(tl.float32), m, v, *rule)
    tl.store(param + offsets, p.to(param.dtype.element_ty), mask=mask)
    bits = random_bits(positions, count)
    if CODES:
        m_codes, m_scale = e4m3_block_codes(m, bits)
        v_codes, v_scale = e4m3_block_codes(tl.sqrt_rn(v), bits)
        tl.store(exp_avg + offsets, m_codes, mask=mask)
        tl.store(exp_avg_sq + offsets, v_codes, mask=mask)
        tl.store(scale_m, m_scale, mask=scale_mask)
        tl.store(scale_v, v_scale, mask=scale_mask)
    else:
        tl.store(exp_avg + offsets, bfloat16_rounded(m, bits), mask=mask)
        tl.store(exp_avg_sq + offsets, bfloat16_rounded(v, bits), mask=mask)


def adamw_flagged_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                   exp_avg_sqs: Sequence[Tensor], steps: Sequence[Tensor], skipped: Tensor, *, lr: float | Tensor,
                   betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """One AdamW step (decoupled weight decay, torch.optim.AdamW's arithmetic) on every tensor whose flag in
    `skipped` ((N,) float32) is 0.0, whose step count (a float32 scalar, read as it was before this step) then moves
    by one; the others, their moments and counts included, are left as they are. Parameters, gradients and moments:
    contiguous, of one dtype (float32, bfloat16 or float16), on one device, starting on 16-byte boundaries; `lr` a
    number or a one-element tensor there."""
    tensors = _checked(params, grads, exp_avgs, exp_avg_sqs, steps, skipped)
    if not tensors:
        return
    device = params[0].device
    if isinstance(lr, Tensor) and (lr.numel() != 1 or lr.device != device):
        raise ValueError(f"lr is a tensor of shape {tuple(lr.shape)} on {lr.device}; expected one element on {device}")
    tabulated = tabulate(tensors)
    launch_adamw_(tabulated, skipped, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    launch_counts_(tabulated, skipped)


@dataclass(frozen=True)
class Tabulated:
    """Tensors of one dtype and one stored form of their moments, as the kernels read them: the address table and
    the programs' tables (on the device), the tensors the table's 16-byte units count from, and which form."""

    table: Tensor
    block_tensor: Tensor
    block_start: Tensor
    like: Tensor
    moment_like: Tensor | None  # the first moment the moments' units count from, where they are stored rounded
    codes: bool  # rounded moments as 8-bit codes with block scales (else bfloat16)
    skip_counts: bool

    @property
    def columns(self) -> int:
        return _COLUMNS if self.moment_like is None else _ROUNDED_COLUMNS


def tabulate(tensors: Sequence[tuple[Tensor, ...]], skip_counts: Sequence[Tensor] | None = None) -> Tabulated:
    """(param, grad, exp_avg, exp_avg_sq, step) rows that `launchable` took, at least one, of one dtype, with each
    tensor's skip count (int64) where the counts launch moves them: unchecked, for the optimizer's step, which picks
    its rows with `launchable` (checking them again cost GPT-2 small's 97 AdamW tensors ~0.3 ms of host time per
    step)."""
    like = tensors[0][0]
    base = like.data_ptr()
    rows: list[int] = []
    for (param, grad, exp_avg, exp_avg_sq, step), skip_count in zip(tensors, _addresses(skip_counts, len(tensors))):
        rows += (*_units(base, param, grad, exp_avg, exp_avg_sq), step.data_ptr(), param.numel(), skip_count)
    return Tabulated(*_tables(tuple(rows), _COLUMNS, like.device), like, None, False, skip_counts is not None)


def tabulate_rounded(tensors: Sequence[tuple[Tensor | None, ...]],
                     skip_counts: Sequence[Tensor] | None = None) -> Tabulated:
    """`tabulate` for moments stored rounded at random, on (param, grad, exp_avg, exp_avg_sq, step, rounding_count,
    exp_avg_scales, exp_avg_sq_scales, positions) rows that `launchable_rounded` took, of one parameter dtype and
    one stored form (bfloat16 moments, or 8-bit codes with their scales); positions (`EntryPositions` on the
    parameter's device) for a shard, None for a whole tensor."""
    like, moment_like, codes = tensors[0][0], tensors[0][2], tensors[0][6] is not None
    base, moment_base = like.data_ptr(), moment_like.data_ptr()
    rows: list[int] = []
    for (param, grad, exp_avg, exp_avg_sq, step, count, *scales, positions), skip_count in zip(
            tensors, _addresses(skip_counts, len(tensors))):
        rows += (*_units(base, param, grad), *_units(moment_base, exp_avg, exp_avg_sq), step.data_ptr(), param.numel(),
                 count.data_ptr(), *[scale.data_ptr() if codes else 0 for scale in scales], *_positions_row(positions),
                 skip_count)
    return Tabulated(*_tables(tuple(rows), _ROUNDED_COLUMNS, like.device), like, moment_like, codes,
                     skip_counts is not None)


def _positions_row(positions: EntryPositions | None) -> tuple[int, int, int]:
    """A shard's positions as the table holds them: the addresses of its row and column positions, and its count of
    columns; zeros for a whole tensor."""
    if positions is None:
        return 0, 0, 0
    return positions.rows.data_ptr(), positions.columns.data_ptr(), len(positions.columns)


def _addresses(tensors: Sequence[Tensor] | None, count: int) -> list[int]:
    """Each tensor's address, or 0 for each of `count` rows where there are none."""
    return [tensor.data_ptr() for tensor in tensors] if tensors is not None else [0] * count


def launch_nonfinite_(tabulated: Tabulated) -> Tensor:
    """(N,) float32 flags on the device: 1.0 where a tabulated tensor's gradient holds a NaN or Inf, else 0.0; one
    launch, no host sync."""
    like = tabulated.like
    flags = torch.zeros(tabulated.table.numel() // tabulated.columns, dtype=torch.float32, device=like.device)
    _nonfinite_blocks_kernel[(tabulated.block_tensor.numel(),)](
        tabulated.table, tabulated.block_tensor, tabulated.block_start, flags, like, COLUMNS=tabulated.columns,
        ELEMENTS_PER_UNIT=ALIGNMENT // like.element_size(), BLOCK=BLOCK)
    return flags


def launch_adamw_(tabulated: Tabulated, skipped: Tensor, *, lr: float | Tensor, betas: tuple[float, float],
                  eps: float, weight_decay: float, rates: Tensor | None = None) -> None:
    """The update of every tabulated tensor whose flag in `skipped` is 0.0, its step count read as it was before this
    step (`launch_counts_` moves it after). Moments stored rounded are each read into float32, stepped with their
    parameter and stored back rounded with random bits salted by its count of rounded writes and each entry's index,
    as the CPU's `adamw_rounded_` does. `rates`: (lr, weight decay) float64 pairs on the device, one per tabulated
    tensor, in place of `lr` and `weight_decay` (param groups sharing the launch)."""
    like, moment_like = tabulated.like, tabulated.moment_like
    tables = (tabulated.table, tabulated.block_tensor, tabulated.block_start, skipped)
    rule = _rule_arguments(lr, betas, eps, weight_decay, tabulated.table, rates)
    mode = 2 if rates is not None else int(isinstance(lr, Tensor))
    grid = (tabulated.block_tensor.numel(),)
    if moment_like is None:
        _adamw_blocks_kernel[grid](*tables, like, *rule, RATES=mode, COLUMNS=_COLUMNS,
                                   ELEMENTS_PER_UNIT=ALIGNMENT // like.element_size(), BLOCK=BLOCK)
        return
    _adamw_rounded_blocks_kernel[grid](
        *tables, like, moment_like.view(torch.int8 if tabulated.codes else torch.int16), *rule,
        RATES=mode, CODES=tabulated.codes, COLUMNS=_ROUNDED_COLUMNS,
        ELEMENTS_PER_UNIT=ALIGNMENT // like.element_size(),
        MOMENT_ELEMENTS_PER_UNIT=ALIGNMENT // moment_like.element_size(), BLOCK=BLOCK, CODE_BLOCK=CODE_BLOCK,
    )


def launch_counts_(tabulated: Tabulated, skipped: Tensor) -> None:
    """After `launch_adamw_`: each tabulated tensor's step count moves by 1 - flag, its skip count (where tabulated)
    by its flag, and a count of rounded writes by 1 - flag; one launch."""
    _counts_kernel[(tabulated.table.numel() // tabulated.columns,)](
        tabulated.table, skipped, COLUMNS=tabulated.columns, ROUNDED=tabulated.moment_like is not None,
        SKIP_COUNTS=tabulated.skip_counts)


def _rule_arguments(lr: float | Tensor, betas: tuple[float, float], eps: float, weight_decay: float,
                    placeholder: Tensor, rates: Tensor | None) -> tuple[Tensor | float, ...]:
    """The update rule's arguments both kernels end with: the rates on the device (per-tensor pairs, or lr as a
    tensor; `placeholder` where neither) and lr as a number (0.0 where it is on the device), the betas and their
    base-2 logarithms, eps and the weight decay."""
    beta1, beta2 = betas
    on_device = rates if rates is not None else lr if isinstance(lr, Tensor) else placeholder
    return (on_device, 0.0 if isinstance(lr, Tensor) else float(lr), beta1, beta2, _log2(beta1), _log2(beta2), eps,
            weight_decay)


def launchable(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor) -> bool:
    """Whether the kernel takes this parameter: its four tensors of one shape and of one dtype it supports, each
    where the kernel reads it (`adamw_takes`), and a float32 step count."""
    dtype = param.dtype
    return (dtype in SUPPORTED_DTYPES and step.dtype == torch.float32
            and _taken(((param, dtype), (grad, dtype), (exp_avg, dtype), (exp_avg_sq, dtype)), param.shape))


def launchable_rounded(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor,
                       rounding_count: Tensor, exp_avg_scales: Tensor | None, exp_avg_sq_scales: Tensor | None) -> bool:
    """Whether the rounded kernel takes this parameter (a whole tensor or a shard, whose positions it reads as they
    are): parameter and gradient of one shape and dtype it supports, moments of that shape stored as bfloat16 or,
    with float32 scales, as 8-bit codes along a last dim of whole CODE_BLOCKs, each where the kernel reads it
    (`adamw_takes`); a float32 step count and an int64 rounding count."""
    dtype, shape = param.dtype, param.shape
    if exp_avg_scales is None and exp_avg_sq_scales is None:
        stored = torch.bfloat16
    elif exp_avg_scales is not None and exp_avg_sq_scales is not None:
        stored = torch.int8
        if not shape or shape[-1] % CODE_BLOCK or not all(scales.dtype == torch.float32 and scales.is_contiguous()
                                                          for scales in (exp_avg_scales, exp_avg_sq_scales)):
            return False
    else:
        return False
    return (dtype in SUPPORTED_DTYPES and step.dtype == torch.float32 and rounding_count.dtype == torch.int64
            and _taken(((param, dtype), (grad, dtype), (exp_avg, stored), (exp_avg_sq, stored)), shape))


def _taken(tensors: tuple[tuple[Tensor, torch.dtype], ...], shape: torch.Size) -> bool:
    """Whether each tensor has its dtype and this shape, where the kernel reads it (`adamw_takes`). A loop, not all()
    over a generator: it runs for every AdamW tensor at every step (1.8 µs a tensor, not 2.1)."""
    for tensor, dtype in tensors:
        if tensor.dtype != dtype or tensor.shape != shape or not adamw_takes(tensor):
            return False
    return True


def adamw_takes(tensor: Tensor) -> bool:
    """Whether the kernel reads and writes this tensor where it lies: contiguous, from a 16-byte boundary (an empty
    one from anywhere; asked second, as it rarely decides)."""
    return tensor.is_contiguous() and (tensor.data_ptr() % ALIGNMENT == 0 or tensor.numel() == 0)


def _log2(beta: float) -> float:
    """log2 of a beta in [0, 1): beta = 0 gives -inf, whose exp2 at any step >= 1 is beta^step = 0."""
    return math.log2(beta) if beta > 0 else -math.inf


def _checked(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
             exp_avg_sqs: Sequence[Tensor], steps: Sequence[Tensor], skipped: Tensor) -> list[tuple[Tensor, ...]]:
    lists = {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "steps": steps}
    counts = {name: len(tensors) for name, tensors in lists.items()}
    if len(set(counts.values())) != 1 or tuple(skipped.shape) != (len(params),):
        raise ValueError(f"one of each per parameter and skipped of shape ({len(params)},); got {counts} and "
                         f"skipped of shape {tuple(skipped.shape)}")
    if not params:
        return []
    dtype, device = params[0].dtype, params[0].device
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"params have dtype {dtype}; expected float32, bfloat16 or float16")
    if skipped.dtype != torch.float32 or skipped.device != device:
        raise ValueError(f"skipped is {skipped.dtype} on {skipped.device}; expected torch.float32 on {device}")
    if not INTERPRETER and device.type == "cpu":
        raise ValueError("the tensors are on the CPU; the Triton kernels need a GPU (or TRITON_INTERPRET=1)")
    tensors = list(zip(params, grads, exp_avgs, exp_avg_sqs, steps))
    for index, (param, *others, step) in enumerate(tensors):
        for name, tensor in zip(("params", "grads", "exp_avgs", "exp_avg_sqs"), (param, *others)):
            if tensor.dtype != dtype or tensor.device != device or tensor.shape != param.shape:
                raise ValueError(f"{name}[{index}] is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}; "
                                 f"expected params[{index}]'s {tuple(param.shape)}, {dtype} on {device}")
            if not adamw_takes(tensor):
                raise ValueError(f"{name}[{index}] is not contiguous from a {ALIGNMENT}-byte boundary (strides "
                                 f"{tensor.stride()}, starting at {tensor.data_ptr():#x})")
        if step.dtype != torch.float32 or step.numel() != 1 or step.device != device:
            raise ValueError(f"steps[{index}] is {tuple(step.shape)} {step.dtype} on {step.device}; expected one "
                             f"float32 on {device}")
    return tensors


def _units(base: int, *tensors: Tensor) -> tuple[int, ...]:
    """Where each tensor starts, in 16-byte units from `base`."""
    return tuple([(tensor.data_ptr() - base) // ALIGNMENT for tensor in tensors])


def _tables(rows: tuple[int, ...], columns: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The address table (`rows`, `columns` values per tensor), then each program's tensor and first element, which
    depend only on the tensors' sizes. Each is kept on the device for the next steps: the addresses of parameters and
    moments stay, and a gradient's usually do too, as the caching allocator hands the same blocks out again."""
    return device_values(rows, torch.int64, device), *_block_tables(rows[_NUMEL::columns], device)


@functools.lru_cache(maxsize=16)  # a few AdamW parameter lists (one per dtype) per optimizer, a few optimizers
def _block_tables(numels: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """Each program's tensor and its first element in that tensor, for tensors of these sizes (GPT-2 small's 97 AdamW
    tensors make 18,967 programs: 0.25 ms of host work and 300 KB to copy each step, were they rebuilt)."""
    blocks = (torch.tensor(numels, dtype=torch.int64, device="cpu") + BLOCK - 1) // BLOCK
    block_tensor = torch.repeat_interleave(torch.arange(len(numels), device="cpu"), blocks)
    first_block = torch.cumsum(blocks, 0) - blocks
    block_start = (torch.arange(block_tensor.numel(), device="cpu") - first_block[block_tensor]) * BLOCK
    return block_tensor.to(device), block_start.to(device)
