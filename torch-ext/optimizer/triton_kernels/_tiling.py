"""Device functions shared by the symmetric kernels: which lower tile a program owns, that tile of S @ S^T, and a
store that fills the tile and its mirror.

Programs walk the lower triangle row by row. A grouped (super-row) order is not used: consecutive programs already
share their row block, and a wave of programs spans only about sqrt(2 * SM count) row blocks, whose K slices fit
in L2 together.
"""

import triton
import triton.language as tl


@triton.jit
def lower_tile_coords(pid):
    """(row, col), col <= row, of the pid-th lower tile in row-major order. Works on scalars and tensors."""
    # Row r starts at index r(r+1)/2: invert that with the quadratic formula, then step once either way to undo
    # any rounding of the float square root.
    row = ((tl.sqrt_rn((8 * pid + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    row = tl.where(row * (row + 1) // 2 > pid, row - 1, row)
    row = tl.where((row + 1) * (row + 2) // 2 <= pid, row + 1, row)
    return row, pid - row * (row + 1) // 2


@triton.jit
def gram_tile(
    src,
    row_tile,
    col_tile,
    M,
    K,
    stride_m,
    stride_k,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    """Tile (row_tile, col_tile) of S @ S^T in fp32, S being the M x K matrix at src. Both operands are row blocks
    of S, read along their rows, so for a symmetric S this is also the tile of S @ S."""
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    left = src + rows[:, None].to(tl.int64) * stride_m + ks[None, :] * stride_k
    right = src + cols[None, :].to(tl.int64) * stride_m + ks[:, None] * stride_k
    acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_inside = ks < K - k_start
        a = tl.load(left, mask=(rows[:, None] < M) & k_inside[None, :], other=0.0)
        b = tl.load(right, mask=k_inside[:, None] & (cols[None, :] < M), other=0.0)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE_FP32:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        left += BLOCK_K * stride_k
        right += BLOCK_K * stride_k
    return acc


@triton.jit
def load_tile_fp32(src, row_tile, col_tile, M, stride_m, stride_n, BLOCK_M: tl.constexpr):
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (rows[:, None] < M) & (cols[None, :] < M)
    tile = tl.load(src + rows[:, None].to(tl.int64) * stride_m + cols[None, :] * stride_n, mask=mask, other=0.0)
    return tile.to(tl.float32)


@triton.jit
def store_mirrored(dst, tile, row_tile, col_tile, M, stride_m, stride_n, BLOCK_M: tl.constexpr):
    """Write tile at (row_tile, col_tile), col_tile <= row_tile, and its transpose at (col_tile, row_tile). On a
    diagonal tile the lower half comes from tile and the strict upper half from its transpose, so the output is
    symmetric bit for bit even where the accumulation order left tile itself not quite symmetric."""
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    value = tile.to(dst.dtype.element_ty)
    # Off the diagonal every row index exceeds every column index, so the triangle tests only bite on the diagonal.
    lower = (rows[:, None] < M) & (cols[None, :] <= rows[:, None])
    tl.store(dst + rows[:, None].to(tl.int64) * stride_m + cols[None, :] * stride_n, value, mask=lower)

    # Element (r, c) of tile lands at (c, r); the pointer grid is laid out in the mirror's own row order.
    strictly_upper = (rows[None, :] < M) & (cols[:, None] < rows[None, :])
    mirror = dst + cols[:, None].to(tl.int64) * stride_m + rows[None, :] * stride_n
    tl.store(mirror, tl.trans(value), mask=strictly_upper)
