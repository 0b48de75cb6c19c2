"""Host-side rules shared by the symmetric kernels' launchers: configs, input checks, output allocation, grid."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
from torch import Tensor

# Decided once, like Triton itself decides at decoration time whether @triton.jit kernels run interpreted.
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# CUDA caps grid dimension y (the batch axis here) at 65535.
MAX_BATCH = 65535

# The interpreter's cost is Python work per program and per K step, so it gets one large tile (autotuning between
# several configs would call do_bench, which needs a GPU).
INTERPRETER_BLOCK_M = 128
INTERPRETER_BLOCK_K = 128


def symmetric_tile_configs() -> list[triton.Config]:
    """Square output tiles (BLOCK_M x BLOCK_M) and a K step; a mirror needs square tiles. The first three are the
    candidates; the last two are for when none of them fits the GPU's shared memory (fp32 operands, small GPUs)."""
    if INTERPRETER:
        return [triton.Config({"BLOCK_M": INTERPRETER_BLOCK_M, "BLOCK_K": INTERPRETER_BLOCK_K})]
    return [
        # What the autotuner chose on an H100 from 4096 rows on (benchmarks/results/), and a 4-warp variant.
        triton.Config({"BLOCK_M": 128, "BLOCK_K": 64}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
        # Small Gram matrices have few lower tiles: smaller tiles keep more SMs busy (chosen below 4096 rows there).
        triton.Config({"BLOCK_M": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_K": 32}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_K": 32}, num_warps=4, num_stages=2),
    ]


_CANDIDATES = 3
# From this many rows even 128-row tiles give every SM of a large GPU several lower tiles, so the autotuner does not
# compile and time the small-tile config there.
SMALL_TILES_BELOW_ROWS = 4096


# Headroom for the epilogue, whose transposed store goes through shared memory.
EPILOGUE_SHARED_BYTES = 16 * 1024


def _operand_bytes(config: triton.Config, element_size: int) -> int:
    """Shared memory the software pipeline stages: both K slices, once per stage."""
    return 2 * config.kwargs["BLOCK_M"] * config.kwargs["BLOCK_K"] * element_size * config.num_stages


def _max_shared_memory() -> int:
    device = torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(device)["max_shared_mem"]


def prune_tile_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The candidates whose pipeline fits this GPU's shared memory (else the fallbacks that fit), without the small
    tiles for large Gram matrices."""
    element_size = next(arg.element_size() for arg in named_args.values() if isinstance(arg, Tensor))
    limit = _max_shared_memory() - EPILOGUE_SHARED_BYTES
    fitting = [(index, config) for index, config in enumerate(configs)
               if _operand_bytes(config, element_size) <= limit]
    candidates = ([config for index, config in fitting if index < _CANDIDATES]
                  or [config for _, config in fitting] or configs[-1:])
    if named_args["M"] >= SMALL_TILES_BELOW_ROWS:
        candidates = [config for config in candidates if config.kwargs["BLOCK_M"] >= 128] or candidates
    return candidates


def check_operand(name: str, operand: Tensor, *, square: bool) -> None:
    if operand.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {operand.dtype}; expected float32, bfloat16 or float16")
    if operand.ndim not in (2, 3):
        raise ValueError(f"{name} must be (m, n) or (batch, m, n); got shape {tuple(operand.shape)}")
    if square and operand.shape[-1] != operand.shape[-2]:
        raise ValueError(f"{name} must be square in its last two dims; got shape {tuple(operand.shape)}")
    if operand.ndim == 3 and operand.shape[0] > MAX_BATCH:
        raise ValueError(f"{name} has batch size {operand.shape[0]}; at most {MAX_BATCH} per launch")
    if not INTERPRETER and operand.device.type == "cpu":
        raise ValueError(
            f"{name} is on the CPU; the Triton kernels need a GPU tensor (or TRITON_INTERPRET=1 set before import)"
        )


def gram_output(name: str, operand: Tensor, out: Tensor | None) -> Tensor:
    """`out`, checked, or a new tensor shaped like operand @ operand^T in operand's dtype."""
    shape = (*operand.shape[:-1], operand.shape[-2])
    if out is None:
        return torch.empty(shape, dtype=operand.dtype, device=operand.device)
    if tuple(out.shape) != shape or out.dtype != operand.dtype or out.device != operand.device:
        expected = f"{shape} {operand.dtype} on {operand.device}"
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype} on {out.device}; expected {expected}")
    if out.untyped_storage().data_ptr() == operand.untyped_storage().data_ptr():
        raise ValueError(f"out shares storage with {name}; the kernel reads {name} while it writes out")
    return out


def as_batched(tensor: Tensor) -> Tensor:
    return tensor if tensor.ndim == 3 else tensor.unsqueeze(0)


def dot_flags(dtype: torch.dtype, exact_fp32: bool) -> dict[str, bool]:
    """UPCAST_DOT works around bf16 `tl.dot` being wrong in the 3.9 interpreter; GPUs keep bf16 on tensor cores.
    IEEE_FP32 trades TF32's speed for full fp32 products, only when asked."""
    return {
        "UPCAST_DOT": INTERPRETER and dtype == torch.bfloat16,
        "IEEE_FP32": exact_fp32 and dtype == torch.float32,
    }


def lower_tile_grid(m: int, batch: int) -> Callable[[dict], tuple[int, int]]:
    """One program per tile on or below the diagonal, times the batch."""

    def grid(meta: dict) -> tuple[int, int]:
        tiles_per_side = triton.cdiv(m, meta["BLOCK_M"])
        return tiles_per_side * (tiles_per_side + 1) // 2, batch

    return grid
