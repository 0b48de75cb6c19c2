"""b*A + c*(A @ A) for symmetric A, computing only the lower tiles and mirroring them."""

from __future__ import annotations

import math

import triton
import triton.language as tl
from torch import Tensor

from ._launch import (as_batched, check_operand, dot_flags, gram_output, k_divides, lower_tile_grid,
                      prune_tile_configs, symmetric_tile_configs, tma_descriptors)
from ._tiling import gram_tile, load_tile_fp32, store_symmetric, tile_coords


@triton.autotune(configs=symmetric_tile_configs(), key=["M", "TMA_READY", "TMA_STORE_READY"],
                 prune_configs_by={"early_config_prune": prune_tile_configs})
@triton.heuristics({"EVEN_K": k_divides("M")})
@triton.jit
def _ba_plus_caa_lower_kernel(
    a_ptr,
    left_desc,
    right_desc,
    out_ptr,
    tile_desc,
    mirror_desc,
    b,
    c,
    M,
    stride_ab,
    stride_am,
    stride_an,
    stride_ob,
    stride_om,
    stride_on,
    TMA_READY: tl.constexpr,
    TMA_STORE_READY: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TMA: tl.constexpr,
    TMA_STORE: tl.constexpr,
    BAND: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    row_tile, col_tile = tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), BLOCK_N // BLOCK_M, BAND)
    batch = tl.program_id(1)
    matrix = a_ptr + batch.to(tl.int64) * stride_ab
    # A @ A == A @ A^T for symmetric A, which reads both operands along rows.
    square = gram_tile(matrix, left_desc, right_desc, batch, row_tile, col_tile, M, M, stride_am, stride_an, BLOCK_M,
                       BLOCK_N, BLOCK_K, EVEN_K, TMA, UPCAST_DOT, IEEE_FP32)
    linear = load_tile_fp32(matrix, row_tile, col_tile, M, stride_am, stride_an, BLOCK_M, BLOCK_N)
    result = b * linear + c * square
    out = out_ptr + batch.to(tl.int64) * stride_ob
    store_symmetric(out, tile_desc, mirror_desc, result, batch, row_tile, col_tile, M, stride_om, stride_on, BLOCK_M,
                    BLOCK_N, TMA_STORE)


def ba_plus_caa(A: Tensor, b: float, c: float, out: Tensor | None = None, *, exact_fp32: bool = False) -> Tensor:
    """b*A + c*(A @ A) for symmetric A of shape (m, m) or (batch, m, m), in A's dtype (float32, bfloat16 or float16),
    accumulated in float32. Only A's lower triangle reaches the b*A term and A is read as if symmetric, so the
    result is exactly symmetric. On GPUs float32 inputs multiply in TF32 unless `exact_fp32`."""
    check_operand("A", A, square=True)
    for name, value in (("b", b), ("c", c)):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number; got {value}")
    result = gram_output("A", A, out)
    if result.numel() == 0:
        return result
    a3, out3 = as_batched(A), as_batched(result)
    batch, m, _ = a3.shape
    left_desc, right_desc = tma_descriptors(a3)
    tile_desc, mirror_desc = tma_descriptors(out3)
    _ba_plus_caa_lower_kernel[lower_tile_grid(m, batch)](
        a3, left_desc, right_desc, out3, tile_desc, mirror_desc, float(b), float(c), m, *a3.stride(), *out3.stride(),
        TMA_READY=left_desc is not None, TMA_STORE_READY=tile_desc is not None, **dot_flags(A.dtype, exact_fp32)
    )
    return result
