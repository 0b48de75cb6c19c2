"""AdamW on many tensors in one launch, each tensor left untouched where its skip flag is set.

The optimizer skips a parameter whose gradient holds a NaN or Inf, and on a GPU it knows which only on the device
(reading the flags would stall the host). torch's fused AdamW takes one `found_inf` for all its tensors, so a flag
per parameter meant one launch per parameter: 97 for GPT-2 small, each costing more host time than a bias's
update. Here a table of addresses (parameter, gradient, moments, step count, size per tensor) and one flag per
tensor go to a single launch whose programs each update one block of one tensor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import INTERPRETER, SUPPORTED_DTYPES

# Elements per program: enough that a program's scalar work (its tensor's row, the bias corrections) is small beside
# the 16-24 bytes per element it streams, few enough that a bias vector does not leave most of a program idle.
BLOCK = 2048

# A row of the address table per tensor, what each of its programs reads before its block: where its parameter,
# gradient, first and second moment start, in 16-byte units from where the first parameter starts, then its step
# count's address and its size. As multiples of 16 bytes from a pointer argument (which Triton knows to be 16-byte
# aligned), the four tensors' addresses are known to the compiler to be aligned, so it can load and store them 16 bytes
# at a time; raw addresses loaded from memory would tell it nothing and leave it to move one element per instruction.
_COLUMNS = 6
_NUMEL = 5
ALIGNMENT = 16


@triton.jit
def _adamw_blocks_kernel(
    table,
    block_tensor,
    block_start,
    skipped,
    like,
    lr_on_device,
    lr,
    beta1,
    beta2,
    log2_beta1,
    log2_beta2,
    eps,
    weight_decay,
    LR_ON_DEVICE: tl.constexpr,
    COLUMNS: tl.constexpr,
    ELEMENTS_PER_UNIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    block = tl.program_id(0)
    tensor = tl.load(block_tensor + block)
    row = table + tensor * COLUMNS
    param = like + tl.load(row + 0) * ELEMENTS_PER_UNIT
    grad = like + tl.load(row + 1) * ELEMENTS_PER_UNIT
    exp_avg = like + tl.load(row + 2) * ELEMENTS_PER_UNIT
    exp_avg_sq = like + tl.load(row + 3) * ELEMENTS_PER_UNIT
    step = tl.load(tl.load(row + 4).to(tl.pointer_type(tl.float32))).to(tl.float64)
    numel = tl.load(row + 5)
    if LR_ON_DEVICE:
        lr = tl.load(lr_on_device).to(tl.float64)

    # The bias corrections in float64 from the step count as it is after this step's increment, as torch's fused
    # kernel takes them (there with pow; here beta^step as exp2(step * log2 beta)), then the fp32 arithmetic.
    bias_correction1 = 1.0 - tl.exp2(step * log2_beta1)
    bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2)).to(tl.float32)
    step_size = tl.cast(lr / bias_correction1, tl.float32)
    decay = tl.cast(lr * weight_decay, tl.float32)

    # A skipped tensor's programs touch nothing: as if it had no elements.
    end = tl.where(tl.load(skipped + tensor) == 0.0, numel, 0)
    offsets = tl.multiple_of(tl.load(block_start + block), BLOCK) + tl.arange(0, BLOCK)
    mask = offsets < end
    p = tl.load(param + offsets, mask=mask).to(tl.float32)
    g = tl.load(grad + offsets, mask=mask).to(tl.float32)
    m = tl.load(exp_avg + offsets, mask=mask).to(tl.float32)
    v = tl.load(exp_avg_sq + offsets, mask=mask).to(tl.float32)
    p = p - decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denominator = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - tl.div_rn(step_size * m, denominator)
    tl.store(param + offsets, p.to(like.dtype.element_ty), mask=mask)
    tl.store(exp_avg + offsets, m.to(like.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq + offsets, v.to(like.dtype.element_ty), mask=mask)


def adamw_flagged_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                   exp_avg_sqs: Sequence[Tensor], steps: Sequence[Tensor], skipped: Tensor, *, lr: float | Tensor,
                   betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """One AdamW step (decoupled weight decay, torch.optim.AdamW's arithmetic) on every tensor whose flag in
    `skipped` ((N,) float32) is 0.0; the others, their moments included, are left as they are. `steps` (float32
    scalars) are read as already advanced for this step. Parameters, gradients and moments: contiguous, of one
    dtype (float32, bfloat16 or float16), on one device, starting on 16-byte boundaries; `lr` a number or a
    one-element tensor there."""
    tensors = _checked(params, grads, exp_avgs, exp_avg_sqs, steps, skipped)
    if not tensors:
        return
    device = params[0].device
    if isinstance(lr, Tensor) and (lr.numel() != 1 or lr.device != device):
        raise ValueError(f"lr is a tensor of shape {tuple(lr.shape)} on {lr.device}; expected one element on {device}")
    launch_adamw_(tensors, skipped, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def launch_adamw_(tensors: Sequence[tuple[Tensor, ...]], skipped: Tensor, *, lr: float | Tensor,
                  betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """`adamw_flagged_` on (param, grad, exp_avg, exp_avg_sq, step) rows that `launchable` took, at least one, of one
    dtype on `skipped`'s device, with a tensor `lr` there: unchecked, for the optimizer's step, which picks its rows
    with `launchable` (checking them again cost GPT-2 small's 97 AdamW tensors ~0.3 ms of host time per step)."""
    like = tensors[0][0]
    lr_on_device = isinstance(lr, Tensor)
    table, block_tensor, block_start = _launch_tables(tensors, like.device)
    beta1, beta2 = betas
    _adamw_blocks_kernel[(block_tensor.numel(),)](
        table, block_tensor, block_start, skipped, like, lr if lr_on_device else table,
        0.0 if lr_on_device else float(lr), beta1, beta2, _log2(beta1), _log2(beta2), eps, weight_decay,
        LR_ON_DEVICE=lr_on_device, COLUMNS=_COLUMNS, ELEMENTS_PER_UNIT=ALIGNMENT // like.element_size(),
        BLOCK=BLOCK,
    )


def launchable(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor) -> bool:
    """Whether the kernel takes this parameter: its four tensors of one shape and of one dtype it supports, each
    where the kernel reads it (`adamw_takes`), and a float32 step count."""
    dtype, shape = param.dtype, param.shape
    return (dtype in SUPPORTED_DTYPES and step.dtype == torch.float32
            and all(tensor.dtype == dtype and tensor.shape == shape and adamw_takes(tensor)
                    for tensor in (param, grad, exp_avg, exp_avg_sq)))


def adamw_takes(tensor: Tensor) -> bool:
    """Whether the kernel reads and writes this tensor where it lies: contiguous, from a 16-byte boundary (an empty
    one from anywhere)."""
    return tensor.is_contiguous() and (tensor.numel() == 0 or tensor.data_ptr() % ALIGNMENT == 0)


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


def _launch_tables(tensors: Sequence[tuple[Tensor, ...]], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The address table (a row per tensor), then each program's tensor and first element, which depend only on the
    tensors' sizes. Each is kept on the device for the next steps: the addresses of parameters and moments stay, and
    a gradient's usually do too, as the caching allocator hands the same blocks out again."""
    base = tensors[0][0].data_ptr()
    rows = tuple(value for group in tensors
                 for value in (*((tensor.data_ptr() - base) // ALIGNMENT for tensor in group[:4]), group[4].data_ptr(),
                               group[0].numel()))
    return _address_table(rows, device), *_block_tables(rows[_NUMEL::_COLUMNS], device)


@functools.lru_cache(maxsize=16)  # the tables of the last steps, should gradients come back at a few addresses
def _address_table(rows: tuple[int, ...], device: torch.device) -> Tensor:
    """The address table on the device, sent in one copy from pinned memory, so without waiting for the device."""
    table = torch.tensor(rows, dtype=torch.int64)
    return table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table


@functools.lru_cache(maxsize=16)  # a few AdamW parameter lists (one per dtype) per optimizer, a few optimizers
def _block_tables(numels: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """Each program's tensor and its first element in that tensor, for tensors of these sizes (GPT-2 small's 97 AdamW
    tensors make 18,967 programs: 0.25 ms of host work and 300 KB to copy each step, were they rebuilt)."""
    blocks = (torch.tensor(numels, dtype=torch.int64) + BLOCK - 1) // BLOCK
    block_tensor = torch.repeat_interleave(torch.arange(len(numels)), blocks)
    first_block = torch.cumsum(blocks, 0) - blocks
    block_start = (torch.arange(block_tensor.numel()) - first_block[block_tensor]) * BLOCK
    return block_tensor.to(device), block_start.to(device)
