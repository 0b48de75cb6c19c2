"""X @ X^T computing only the lower tiles and mirroring them."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ._launch import (as_batched, check_operand, dot_flags, gram_output, k_divides, lower_tile_grid,
                      prune_tile_configs, symmetric_tile_configs, tma_descriptors)
from ._tiling import gram_tile, store_symmetric, tile_coords


@triton.autotune(configs=symmetric_tile_configs(), key=["M", "K", "TMA_READY", "TMA_STORE_READY"],
                 prune_configs_by={"early_config_prune": prune_tile_configs})
@triton.heuristics({"EVEN_K": k_divides("K")})
@triton.jit
def _xxt_lower_kernel(
    x_ptr,
    left_desc,
    right_desc,
    out_ptr,
    tile_desc,
    mirror_desc,
    M,
    K,
    stride_xb,
    stride_xm,
    stride_xk,
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
    x = x_ptr + batch.to(tl.int64) * stride_xb
    gram = gram_tile(x, left_desc, right_desc, batch, row_tile, col_tile, M, K, stride_xm, stride_xk, BLOCK_M, BLOCK_N,
                     BLOCK_K, EVEN_K, TMA, UPCAST_DOT, IEEE_FP32)
    out = out_ptr + batch.to(tl.int64) * stride_ob
    store_symmetric(out, tile_desc, mirror_desc, gram, batch, row_tile, col_tile, M, stride_om, stride_on, BLOCK_M,
                    BLOCK_N, TMA_STORE)


def xxt(X: Tensor, out: Tensor | None = None, *, exact_fp32: bool = False) -> Tensor:
    """X @ X^T for X of shape (m, n) or (batch, m, n), in X's dtype (float32, bfloat16 or float16), accumulated in
    float32. The result is exactly symmetric. On GPUs float32 inputs multiply in TF32 unless `exact_fp32`."""
    check_operand("X", X, square=False)
    result = gram_output("X", X, out)
    if result.numel() == 0:
        return result
    x3, out3 = as_batched(X), as_batched(result)
    batch, m, n = x3.shape
    left_desc, right_desc = tma_descriptors(x3)
    tile_desc, mirror_desc = tma_descriptors(out3)
    _xxt_lower_kernel[lower_tile_grid(m, batch)](
        x3, left_desc, right_desc, out3, tile_desc, mirror_desc, m, n, *x3.stride(), *out3.stride(),
        TMA_READY=left_desc is not None, TMA_STORE_READY=tile_desc is not None, **dot_flags(X.dtype, exact_fp32)
    )
    return result
