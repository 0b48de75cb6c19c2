"""Host-side rules shared by the kernels' launchers: the symmetric kernels' configs, input checks, output allocation
and grid; the dtypes the kernels take; tables sent to the device."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import triton
from torch import Tensor

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton before 3.4
    TensorDescriptor = None

# Decided once, like Triton itself decides at decoration time whether @triton.jit kernels run interpreted.
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Bytes. The one-launch kernels find each tensor as a multiple of this many bytes from a pointer argument (which Triton
# knows to be 16-byte aligned), so the compiler knows the tensor aligned too and moves 16 bytes per access; a raw
# address loaded from memory would tell it nothing and leave it to move one element per instruction.
ALIGNMENT = 16

# CUDA caps grid dimension y (the batch axis here) at 65535.
MAX_BATCH = 65535

# The interpreter's cost is Python work per program and per K step, so it gets one large tile (autotuning between
# several configs would call do_bench, which needs a GPU). The tile is twice as wide as tall, so the CPU tests run
# the wide tiles' arithmetic; lower_tile_coords is tested at both widths.
INTERPRETER_BLOCK_M = 64
INTERPRETER_BLOCK_N = 128
INTERPRETER_BLOCK_K = 128
# Bands of two row groups, so the kernel tests' few row tiles take both parts of a band (`tile_coords`); the probe
# tests walk both orders at every width.
INTERPRETER_BAND = 4


def _tiles(block_m: int, block_n: int, block_k: int, *, tma: bool = False, tma_store: bool = False, band: int = 0,
           **launch: int) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "TMA": tma,
                          "TMA_STORE": tma_store, "BAND": band}, **launch, pre_hook=_size_descriptor_blocks)


def symmetric_tile_configs() -> list[triton.Config]:
    """Output tiles BLOCK_M x BLOCK_N (BLOCK_N a multiple of BLOCK_M, for the mirror), a K step, whether the
    operands come through TMA descriptors, and whether the tiles below the diagonal and their mirrors are written
    through TMA descriptors too (`store_symmetric`), and the programs' order (`tile_coords`: BAND row tiles at a
    time, or row by row). The first _CANDIDATES are the candidates; the last two are for when none of them fits the
    GPU's shared memory (fp32 operands, small GPUs)."""
    if INTERPRETER:
        return [_tiles(INTERPRETER_BLOCK_M, INTERPRETER_BLOCK_N, INTERPRETER_BLOCK_K, band=INTERPRETER_BAND)]
    return [
        # The tiles of Triton's Hopper matmul tutorials, through TMA and through pointers: a 128x256 tile loads a
        # quarter fewer operand bytes per multiply-add than a 128x128 one. With the TMA stores (what NVIDIA's tsyrk_ex
        # did differently with the same main loop), an H200 took the TMA-store 128x256 tiles from 8192 rows (three or
        # four stages), the four-stage TMA-store 128x128 one from 2048 and 64x64 ones with masked stores below
        # (benchmarks/results/nvidia-h200-2026-11-26-tma-stores.md): 1.27x -> 1.69x cuBLAS's speed at 8192 rows.
        _tiles(128, 256, 64, tma=True, tma_store=True, num_warps=8, num_stages=4),
        _tiles(128, 256, 64, tma=True, tma_store=True, num_warps=8, num_stages=3),
        # The same in bands of 16 row tiles, so that a wave of programs re-reads fewer column blocks from DRAM (the
        # H100's L2 hit rate at 8192 rows was 66.5% row by row: _tiling.py). Not yet timed on a GPU.
        _tiles(128, 256, 64, tma=True, tma_store=True, band=16, num_warps=8, num_stages=4),
        _tiles(128, 128, 64, tma=True, tma_store=True, band=16, num_warps=8, num_stages=4),
        _tiles(128, 256, 64, tma=True, num_warps=8, num_stages=3),
        _tiles(128, 128, 64, tma=True, tma_store=True, num_warps=8, num_stages=4),
        _tiles(128, 128, 64, tma=True, num_warps=8, num_stages=4),
        _tiles(128, 256, 64, num_warps=8, num_stages=3),
        # What the autotuner chose on an H100 from 4096 rows on, before the TMA tiles (benchmarks/results/).
        _tiles(128, 128, 64, num_warps=8, num_stages=4),
        # Small Gram matrices have few lower tiles: smaller tiles keep more SMs busy (chosen below 4096 rows there).
        # They are also the only candidates whose fp32 pipelines fit.
        _tiles(64, 64, 64, tma=True, num_warps=4, num_stages=4),
        _tiles(64, 64, 64, num_warps=4, num_stages=4),
        _tiles(128, 128, 32, num_warps=8, num_stages=3),
        _tiles(64, 64, 32, num_warps=4, num_stages=2),
    ]


_CANDIDATES = 11
# From this many rows even 128-row tiles give every SM of a large GPU several lower tiles, so the autotuner does not
# compile and time the small-tile config there.
SMALL_TILES_BELOW_ROWS = 4096


# Headroom for the epilogue, whose transposed store goes through shared memory.
EPILOGUE_SHARED_BYTES = 16 * 1024


def _operand_bytes(config: triton.Config, element_size: int) -> int:
    """Shared memory the software pipeline stages: both K slices, once per stage."""
    tile = config.kwargs
    return (tile["BLOCK_M"] + tile["BLOCK_N"]) * tile["BLOCK_K"] * element_size * config.num_stages


def _max_shared_memory() -> int:
    device = torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(device)["max_shared_mem"]


def prune_tile_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The candidates whose pipeline fits this GPU's shared memory and, for the TMA ones, whose operand (and output,
    for TMA stores) has TMA descriptors (else the fallbacks that fit), without the small tiles for large Gram
    matrices."""
    element_size = next(arg.element_size() for arg in named_args.values() if isinstance(arg, Tensor))
    limit = _max_shared_memory() - EPILOGUE_SHARED_BYTES
    fitting = [(index, config) for index, config in enumerate(configs)
               if _operand_bytes(config, element_size) <= limit and (kwargs["TMA_READY"] or not config.kwargs["TMA"])
               and (kwargs["TMA_STORE_READY"] or not config.kwargs["TMA_STORE"])]
    candidates = ([config for index, config in fitting if index < _CANDIDATES]
                  or [config for _, config in fitting] or configs[-1:])
    if named_args["M"] >= SMALL_TILES_BELOW_ROWS:
        candidates = [config for config in candidates if config.kwargs["BLOCK_M"] >= 128] or candidates
    return candidates


def tma_descriptors(tensor: Tensor) -> tuple[TensorDescriptor | None, TensorDescriptor | None]:
    """Two TMA descriptors of a (batch, m, k) tensor, the kernels' operand or their output, for its blocks of two
    shapes (an operand's row blocks of the left and of the right factor; an output's tiles and their mirrors: set per
    config, by _size_descriptor_blocks), or (None, None) where TMA cannot address it: a GPU before Hopper, a Triton
    without host descriptors, or a layout TMA cannot address (rows not contiguous, a stride or the start not a
    multiple of 16 bytes)."""
    if TensorDescriptor is None or not _has_tma(tensor.device):
        return None, None
    batch, rows, cols = tensor.shape
    # A lone matrix's batch stride is never used; give it one TMA accepts.
    strides = [tensor.stride(0) if batch > 1 else rows * tensor.stride(1), tensor.stride(1), tensor.stride(2)]
    element_size = tensor.element_size()
    aligned = tensor.data_ptr() % 16 == 0 and all(stride * element_size % 16 == 0 for stride in strides[:2])
    if strides[2] != 1 or not aligned:
        return None, None
    return tuple(TensorDescriptor(tensor, [batch, rows, cols], strides, [1, 16, 16]) for _ in range(2))


def _has_tma(device: torch.device) -> bool:
    if INTERPRETER:
        return True
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def _size_descriptor_blocks(args: dict) -> None:
    """The descriptors' block shapes for the config about to run: one row block of each factor per K step, and one
    output tile and its mirror."""
    if args["left_desc"] is not None:
        args["left_desc"].block_shape = [1, args["BLOCK_M"], args["BLOCK_K"]]
        args["right_desc"].block_shape = [1, args["BLOCK_N"], args["BLOCK_K"]]
    if args["tile_desc"] is not None:
        args["tile_desc"].block_shape = [1, args["BLOCK_M"], args["BLOCK_N"]]
        args["mirror_desc"].block_shape = [1, args["BLOCK_N"], args["BLOCK_M"]]


def k_divides(k_name: str) -> Callable[[dict], bool]:
    """The EVEN_K heuristic: whether the named size is a multiple of the K step, so no load needs a K mask."""
    return lambda args: args[k_name] % args["BLOCK_K"] == 0


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


def lower_tile_count(m: int, block_m: int, block_n: int) -> int:
    """How many BLOCK_M x BLOCK_N tiles reach the diagonal of an m x m matrix or go below it: row tile r needs
    r // width + 1 of them (width = block_n / block_m), the count lower_tile_coords enumerates."""
    width = block_n // block_m
    groups, rest = divmod(triton.cdiv(m, block_m), width)
    return width * groups * (groups + 1) // 2 + rest * (groups + 1)


def lower_tile_grid(m: int, batch: int) -> Callable[[dict], tuple[int, int]]:
    """One program per tile on or below the diagonal, times the batch."""

    def grid(meta: dict) -> tuple[int, int]:
        return lower_tile_count(m, meta["BLOCK_M"], meta["BLOCK_N"]), batch

    return grid


@functools.lru_cache(maxsize=32)  # the tables of the last steps, should gradients come back at a few addresses
def device_values(values: tuple[int | float, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """`values` as a tensor on the device, sent in one copy from pinned memory, so without waiting for the device,
    and kept for the next steps that ask for the same values (a launch's address table, while the addresses stay)."""
    table = torch.tensor(values, dtype=dtype, device="cpu")
    return table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table
