"""X @ X^T computing only the lower tiles and mirroring them."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ._launch import (as_batched, check_operand, dot_flags, gram_output, lower_tile_grid, prune_tile_configs,
                      symmetric_tile_configs)
from ._tiling import gram_tile, lower_tile_coords, store_mirrored


@triton.autotune(configs=symmetric_tile_configs(), key=["M", "K"],
                 prune_configs_by={"early_config_prune": prune_tile_configs})
@triton.jit
def _xxt_lower_kernel(
    x_ptr,
    out_ptr,
    M,
    K,
    stride_xb,
    stride_xm,
    stride_xk,
    stride_ob,
    stride_om,
    stride_on,
    UPCAST_DOT: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row_tile, col_tile = lower_tile_coords(tl.program_id(0))
    batch = tl.program_id(1).to(tl.int64)
    x = x_ptr + batch * stride_xb
    gram = gram_tile(x, row_tile, col_tile, M, K, stride_xm, stride_xk, BLOCK_M, BLOCK_K, UPCAST_DOT, IEEE_FP32)
    store_mirrored(out_ptr + batch * stride_ob, gram, row_tile, col_tile, M, stride_om, stride_on, BLOCK_M)


def xxt(X: Tensor, out: Tensor | None = None, *, exact_fp32: bool = False) -> Tensor:
    """X @ X^T for X of shape (m, n) or (batch, m, n), in X's dtype (float32, bfloat16 or float16), accumulated in
    float32. The result is exactly symmetric. On GPUs float32 inputs multiply in TF32 unless `exact_fp32`."""
    check_operand("X", X, square=False)
    result = gram_output("X", X, out)
    if result.numel() == 0:
        return result
    x3, out3 = as_batched(X), as_batched(result)
    batch, m, n = x3.shape
    _xxt_lower_kernel[lower_tile_grid(m, batch)](
        x3, out3, m, n, *x3.stride(), *out3.stride(), **dot_flags(X.dtype, exact_fp32)
    )
    return result
