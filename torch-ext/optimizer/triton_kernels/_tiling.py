"""Device functions shared by the symmetric kernels: which lower tile a program owns, that tile of S @ S^T, and a
store that fills the tile and its mirror.

An output tile is BLOCK_M rows by BLOCK_N = WIDTH * BLOCK_M columns. Wide tiles load fewer operand bytes per
multiply-add (a 128x256 tile a quarter fewer than two 128x128 ones), which is what a Hopper GPU's tensor cores need to
stay busy; on the diagonal they compute some upper elements the store then drops (1.5% of the tiles at 8192 rows).
The mirror store only needs each tile's rows and columns, so nothing else cares about the tile's shape. A tile wholly
below the diagonal can go out through TMA descriptors, as two bulk copies from shared memory (one of its transpose),
where the masked stores of a tile that crosses the diagonal take a store per element pair and a layout change.

Programs walk the lower triangle row by row, or band by band (`tile_coords`). Row by row, a wave of programs (one per
SM) spans a few row blocks but every column block left of them, and each K step reads all of those: at 8192 rows on
an H100, 128x256 tiles, about 119 MB from DRAM a wave, where Nsight Compute measured an L2 hit rate of 66.5% against
81.1% for NVIDIA's tsyrk_ex with the same main loop (the H100's ncu log of 2026-11-26 in benchmarks/results/). Band
by band, a wave covers about BAND row blocks and 132 / BAND column blocks: 16 by 8 reads about 67 MB. The autotuner
picks between the two orders per shape.
"""

import triton
import triton.language as tl


@triton.jit
def triangle_row(index):
    """r with r(r+1)/2 <= index < (r+1)(r+2)/2: the row of the index-th element of a lower triangle walked row by
    row. Works on scalars and tensors."""
    # Invert r(r+1)/2 with the quadratic formula, then step once either way to undo any rounding of the float32
    # square root (from row 4607 on it alone lands one row too far).
    row = ((tl.sqrt_rn((8 * index + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    row = tl.where(row * (row + 1) // 2 > index, row - 1, row)
    return tl.where((row + 1) * (row + 2) // 2 <= index, row + 1, row)


@triton.jit
def lower_tile_coords(pid, WIDTH: tl.constexpr):
    """(row, col) of the pid-th tile, in row-major order, of those that reach the diagonal or below it, for tiles
    WIDTH times as wide as tall: row tile r needs column tiles 0..r // WIDTH. Works on scalars and tensors."""
    # Row tiles come in groups of WIDTH that need the same columns: group g holds WIDTH * (g + 1) tiles, so the
    # groups form a triangle scaled by WIDTH.
    group = triangle_row(pid // WIDTH)
    offset = pid - WIDTH * (group * (group + 1) // 2)
    return WIDTH * group + offset // (group + 1), offset % (group + 1)


@triton.jit
def tile_coords(pid, row_tiles, WIDTH: tl.constexpr, BAND: tl.constexpr):
    """(row, col) of the tile the pid-th program computes, of the lower tiles of a matrix of row_tiles row tiles: row
    by row (BAND 0, `lower_tile_coords`), or in bands of BAND row tiles (a multiple of WIDTH), each band's columns
    that all its rows need taken column by column, then the rest of the band, the part along the diagonal, row by
    row. A band holds whole groups of WIDTH rows, which are the same programs in either order."""
    if BAND == 0:
        return lower_tile_coords(pid, WIDTH)
    else:
        band = triangle_row(pid // WIDTH) // (BAND // WIDTH)
        first_row = band * BAND
        first_group = band * (BAND // WIDTH)
        index = pid - WIDTH * (first_group * (first_group + 1) // 2)
        height = tl.minimum(row_tiles - first_row, BAND)  # the last band may be cut short
        # Every row of the band needs columns 0..first_group; row first_row + WIDTH + i beyond them needs what row i
        # of a lower triangle of WIDTH-wide tiles needs.
        shared = (first_group + 1) * height
        in_shared = index < shared
        beyond_row, beyond_col = lower_tile_coords(tl.maximum(index - shared, 0), WIDTH)
        row = tl.where(in_shared, first_row + index % height, first_row + WIDTH + beyond_row)
        col = tl.where(in_shared, index // height, first_group + 1 + beyond_col)
        return row, col


@triton.jit
def gram_tile(
    src,
    left_desc,
    right_desc,
    batch,
    row_tile,
    col_tile,
    M,
    K,
    stride_m,
    stride_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    """Tile (row_tile, col_tile) of S @ S^T in fp32, S being the M x K matrix at src (batch `batch` of the
    descriptors). Both operands are row blocks of S, read along their rows, so for a symmetric S this is also the
    tile of S @ S. With TMA the operands come through the descriptors (Hopper's tensor memory accelerator, which
    fills what lies outside S with zeros); otherwise through pointers, where rows past M wrap around instead of being
    masked (their results are never stored), so only a K tail, where K is not a multiple of BLOCK_K, costs masked
    loads."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        for k_start in range(0, K, BLOCK_K):
            a = left_desc.load([batch, row_tile * BLOCK_M, k_start]).reshape(BLOCK_M, BLOCK_K)
            b = right_desc.load([batch, col_tile * BLOCK_N, k_start]).reshape(BLOCK_N, BLOCK_K)
            acc = _multiply_add(a, b.T, acc, UPCAST_DOT, IEEE_FP32)
    else:
        rows = (row_tile * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        cols = (col_tile * BLOCK_N + tl.arange(0, BLOCK_N)) % M
        ks = tl.arange(0, BLOCK_K)
        left = src + rows[:, None].to(tl.int64) * stride_m + ks[None, :] * stride_k
        right = src + cols[None, :].to(tl.int64) * stride_m + ks[:, None] * stride_k
        for k_start in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(left)
                b = tl.load(right)
            else:
                k_inside = ks < K - k_start
                a = tl.load(left, mask=k_inside[None, :], other=0.0)
                b = tl.load(right, mask=k_inside[:, None], other=0.0)
            acc = _multiply_add(a, b, acc, UPCAST_DOT, IEEE_FP32)
            left += BLOCK_K * stride_k
            right += BLOCK_K * stride_k
    return acc


@triton.jit
def _multiply_add(a, b, acc, UPCAST_DOT: tl.constexpr, IEEE_FP32: tl.constexpr):
    if UPCAST_DOT:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE_FP32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def load_tile_fp32(src, row_tile, col_tile, M, stride_m, stride_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < M)
    tile = tl.load(src + rows[:, None].to(tl.int64) * stride_m + cols[None, :] * stride_n, mask=mask, other=0.0)
    return tile.to(tl.float32)


@triton.jit
def store_mirrored(dst, tile, row_tile, col_tile, M, stride_m, stride_n, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Write the part of tile on or below the diagonal at (row_tile, col_tile) and the transpose of its part
    strictly below the diagonal at the mirror position. Where a tile crosses the diagonal, its elements above it
    are dropped and their places filled from the mirror, so the output is symmetric bit for bit even where the
    accumulation order left the tile itself not quite symmetric."""
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    value = tile.to(dst.dtype.element_ty)
    # A column at or below the diagonal is at most its row, hence inside the matrix when the row is.
    lower = (rows[:, None] < M) & (cols[None, :] <= rows[:, None])
    tl.store(dst + rows[:, None].to(tl.int64) * stride_m + cols[None, :] * stride_n, value, mask=lower)

    # Element (r, c) of tile lands at (c, r); the pointer grid is laid out in the mirror's own row order.
    strictly_lower = (rows[None, :] < M) & (cols[:, None] < rows[None, :])
    mirror = dst + cols[:, None].to(tl.int64) * stride_m + rows[None, :] * stride_n
    tl.store(mirror, tl.trans(value), mask=strictly_lower)


@triton.jit
def store_symmetric(dst, tile_desc, mirror_desc, tile, batch, row_tile, col_tile, M, stride_m, stride_n,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA_STORE: tl.constexpr):
    """`store_mirrored`, but with TMA_STORE a tile wholly below the diagonal and its transpose are written through
    the output's descriptors (blocks of batch `batch`; TMA drops what lies outside the matrix)."""
    if TMA_STORE:
        if row_tile * BLOCK_M >= (col_tile + 1) * BLOCK_N:
            value = tile.to(dst.dtype.element_ty)
            tile_desc.store([batch, row_tile * BLOCK_M, col_tile * BLOCK_N], value.reshape(1, BLOCK_M, BLOCK_N))
            mirror_desc.store([batch, col_tile * BLOCK_N, row_tile * BLOCK_M],
                              tl.trans(value).reshape(1, BLOCK_N, BLOCK_M))
        else:
            store_mirrored(dst, tile, row_tile, col_tile, M, stride_m, stride_n, BLOCK_M, BLOCK_N)
    else:
        store_mirrored(dst, tile, row_tile, col_tile, M, stride_m, stride_n, BLOCK_M, BLOCK_N)
