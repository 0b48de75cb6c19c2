// out = alpha * X X^T + beta * C on the CPU with about half the multiply-adds of a full GEMM: only tiles on and
// below the diagonal are computed, each by torch's own GEMM (so the BLAS under torch does the arithmetic), then the
// strictly-lower triangle is mirrored into the upper one, which makes out exactly symmetric.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "transpose_cpu.h"
#include "vector_clones.h"

namespace {

// Two tilings, measured with torch on 2 cores (MKL for float32, oneDNN with AMX for bfloat16; m = 512 to 4096,
// k = 512 to 4096, against each other and against 128 to 384 rows per block). Below kHalvingMinRows, row panels of
// kPanelRows rows, their diagonal blocks in sub-panels of kDiagonalRows rows: a few wide GEMMs, about
// (m^2 + m kDiagonalRows) k / 2 multiply-adds. From it on, recursive halving down to blocks of kHalvingBlockRows rows,
// about (m^2 + m kHalvingBlockRows) k / 2 multiply-adds, with the equal tiles of each level run as one batched GEMM
// (one BLAS batch call): in float32, 5 to 10% faster than whole 256-row panels from m = 2048 on, 5 to 10% slower at
// m = 512 to 768.
constexpr int64_t kPanelRows = 256;
// Panels compute their diagonal block by sub-panels of this many rows, each up to its own diagonal: the BLAS ran them
// at nearly the full panel's rate (2-core AMD EPYC), so the block's upper half is no longer multiplied. In bf16
// (oneDNN, AVX512-BF16): X Xᵀ of one 768x3072 matrix in 5.2 instead of 6.0 ms (torch.mm 8.4), of GPT-2's
// (12, 768, 3072) stack in 65.7 instead of 71.7 ms, of a (4, 1024, 4096) one in 51.2 instead of 54.3 (paired runs);
// (12, 768, 768) about the same. In float32 (MKL): the (12, 768, 3072) stack in 147 instead of 158 ms, (12, 768, 768)
// in 38.8 instead of 42.3, (4, 512, 2048) in 15.9 instead of 18.4 (paired); one 1000x4000 matrix the same. 128-row
// panels throughout were as fast at 768 rows, slower at 1024.
constexpr int64_t kDiagonalRows = 128;
constexpr int64_t kHalvingMinRows = 1024;
constexpr int64_t kHalvingBlockRows = 128;
// Square blocks of the mirror pass: the fastest of 16 to 64 rows and columns, in float32 and bfloat16 alike.
constexpr int64_t kMirrorBlock = 64;
// Elements per mirror task at the least, so that small matrices are mirrored without waking other threads.
constexpr int64_t kMirrorGrainElements = 32768;

struct GramTerms {
  at::Tensor X;  // (m, k)
  std::optional<at::Tensor> C;  // (m, m) or absent
  double alpha;
  double beta;
};

// `count` tiles of out, each `rows` x `cols`, the first at (row, col), each next one `step` rows down and `step`
// columns right.
struct Tiles {
  int64_t count;
  int64_t row;
  int64_t col;
  int64_t step;
  int64_t rows;
  int64_t cols;
};

// The tiles of a matrix (out or C) as one (count, rows, cols) view.
at::Tensor tiles_of(const at::Tensor& matrix, const Tiles& tiles) {
  const int64_t row_stride = matrix.stride(0);
  const int64_t col_stride = matrix.stride(1);
  return matrix.as_strided({tiles.count, tiles.rows, tiles.cols},
                           {tiles.step * (row_stride + col_stride), row_stride, col_stride},
                           matrix.storage_offset() + tiles.row * row_stride + tiles.col * col_stride);
}

// `count` blocks of `rows` rows of X, the first at row `first`, each next one `step` rows down: (count, rows, k).
at::Tensor row_blocks(const at::Tensor& X, int64_t count, int64_t first, int64_t step, int64_t rows) {
  return X.as_strided({count, rows, X.size(1)}, {step * X.stride(0), X.stride(0), X.stride(1)},
                      X.storage_offset() + first * X.stride(0));
}

// Each tile of out = alpha * X[tile rows] X[tile cols]^T + beta * C[tile]: every element is one GEMM's dot product
// over the whole of k, accumulated as torch's GEMM does (float32 for reduced precision, float64 for float64).
void gemm_tiles(const at::Tensor& out, const GramTerms& terms, const Tiles& tiles) {
  if (tiles.count == 0) {
    return;
  }
  const at::Tensor left = row_blocks(terms.X, tiles.count, tiles.row, tiles.step, tiles.rows);
  const at::Tensor right = row_blocks(terms.X, tiles.count, tiles.col, tiles.step, tiles.cols).mT();
  if (tiles.count == 1) {
    // One GEMM straight into out; beta = 0 without C, so addmm never reads the tile's old contents (or its NaN).
    at::Tensor tile = tiles_of(out, tiles)[0];
    at::addmm_out(tile, terms.C.has_value() ? tiles_of(*terms.C, tiles)[0] : tile, left[0], right[0],
                  terms.C.has_value() ? terms.beta : 0.0, terms.alpha);
    return;
  }
  // torch runs a batched GEMM as one BLAS batch call only into a contiguous result, hence the staging buffer.
  at::Tensor staged = at::empty({tiles.count, tiles.rows, tiles.cols}, out.options());
  at::baddbmm_out(staged, terms.C.has_value() ? tiles_of(*terms.C, tiles) : staged, left, right,
                  terms.C.has_value() ? terms.beta : 0.0, terms.alpha);
  tiles_of(out, tiles).copy_(staged);
}

// Row panel p holds rows [p b, p b + b): one GEMM from column 0 to its diagonal block, then the diagonal block by
// sub-panels of kDiagonalRows rows, each from the block's first column to its own diagonal block, written whole.
void lower_by_panels(const at::Tensor& out, const GramTerms& terms) {
  const int64_t m = out.size(0);
  for (int64_t begin = 0; begin < m; begin += kPanelRows) {
    const int64_t end = std::min(begin + kPanelRows, m);
    if (begin > 0) {
      gemm_tiles(out, terms, Tiles{1, begin, 0, 0, end - begin, begin});
    }
    for (int64_t sub = begin; sub < end; sub += kDiagonalRows) {
      const int64_t sub_end = std::min(sub + kDiagonalRows, end);
      gemm_tiles(out, terms, Tiles{1, sub, begin, 0, sub_end - sub, sub_end - begin});
    }
  }
}

// Recursive halving, level by level. With blocks of b rows, the level of `group` blocks holds the tiles of rows
// [(2j + 1) g, (2j + 2) g) and columns [2j g, (2j + 1) g) (g = group * b), the last one cut short by row m: each pair
// of blocks below the diagonal falls in exactly one level (the highest bit where their indices differ). The diagonal
// blocks are written whole.
void lower_by_halving(const at::Tensor& out, const GramTerms& terms) {
  const int64_t m = out.size(0);
  const int64_t b = kHalvingBlockRows;
  for (int64_t side = b; side < m; side *= 2) {
    const int64_t whole = m / (2 * side);
    gemm_tiles(out, terms, Tiles{whole, side, 0, 2 * side, side, side});
    const int64_t cut_row = (2 * whole + 1) * side;
    if (cut_row < m) {
      gemm_tiles(out, terms, Tiles{1, cut_row, 2 * whole * side, 0, m - cut_row, side});
    }
  }
  const int64_t whole_blocks = m / b;
  gemm_tiles(out, terms, Tiles{whole_blocks, 0, 0, b, b, b});
  const int64_t last = whole_blocks * b;
  if (last < m) {
    gemm_tiles(out, terms, Tiles{1, last, last, 0, m - last, m - last});
  }
}

// out's lower triangle and diagonal, tile after tile: each GEMM already uses every thread. Halving is for float32
// and float64 only: 16-bit GEMMs with AMX (oneDNN) run 128-row tiles far below their full speed, and were 1.5 to 2x
// slower with halving than with panels at m = 1024 to 2048; the dispatcher sends 16-bit products here only on CPUs
// without AMX, where 128-row sub-panels of the diagonal blocks pay (kDiagonalRows).
void lower_gram(const at::Tensor& out, const GramTerms& terms) {
  if (out.size(0) < kHalvingMinRows || out.element_size() < 4) {
    lower_by_panels(out, terms);
  } else {
    lower_by_halving(out, terms);
  }
}

// Copies the strictly-lower triangle of each (m, m) matrix onto the upper one, as raw bits of the element's width.
// A memory-bound pass with no BLAS inside, so it is the one place this file parallelizes itself. Within each square
// block, 8 x 8 sub-blocks wholly above the diagonal are transposed in registers; the diagonal's own sub-blocks and
// the edges of a matrix whose side is no multiple of 8 are copied element by element. Element by element throughout,
// the pass cost as much as a sixth of a 4096-row bf16 Gram product: X Xᵀ of 4096x1024 took 57.9 ms, 48.4 this way
// (float32 115 -> 108; (2, 2048, 512) bf16 18.6 -> 14.1; 768-row matrices, whose triangle stays in cache, the same).
template <typename bits_t>
MUON_VECTOR_CLONES void mirror_lower_to_upper(bits_t* data, int64_t batch, int64_t m) {
  const int64_t blocks = (m + kMirrorBlock - 1) / kMirrorBlock;
  // Block pairs (row block <= column block) of every matrix, flattened so that threads share the triangle evenly.
  std::vector<std::pair<int64_t, int64_t>> pairs;
  pairs.reserve(blocks * (blocks + 1) / 2);
  for (int64_t row_block = 0; row_block < blocks; ++row_block) {
    for (int64_t col_block = row_block; col_block < blocks; ++col_block) {
      pairs.emplace_back(row_block * kMirrorBlock, col_block * kMirrorBlock);
    }
  }
  const int64_t tasks = batch * static_cast<int64_t>(pairs.size());
  const int64_t grain = (kMirrorGrainElements + kMirrorBlock * kMirrorBlock - 1) / (kMirrorBlock * kMirrorBlock);
  at::parallel_for(0, tasks, grain, [&](int64_t task_begin, int64_t task_end) {
    for (int64_t task = task_begin; task < task_end; ++task) {
      bits_t* matrix = data + (task / static_cast<int64_t>(pairs.size())) * m * m;
      const auto [row_begin, col_begin] = pairs[task % static_cast<int64_t>(pairs.size())];
      const int64_t row_end = std::min(row_begin + kMirrorBlock, m);
      const int64_t col_end = std::min(col_begin + kMirrorBlock, m);
      for (int64_t i = row_begin; i < row_end; i += 8) {
        for (int64_t j = std::max(col_begin, i); j < col_end; j += 8) {
          if (j > i && i + 8 <= row_end && j + 8 <= col_end) {
            muon_cpu::transpose8(matrix + j * m + i, m, matrix + i * m + j, m);
            continue;
          }
          for (int64_t row = i; row < std::min(i + 8, row_end); ++row) {
            for (int64_t col = std::max(j, row + 1); col < std::min(j + 8, col_end); ++col) {
              matrix[row * m + col] = matrix[col * m + row];
            }
          }
        }
      }
    }
  });
}

void mirror_lower_to_upper(const at::Tensor& out) {
  const int64_t m = out.size(-1);
  const int64_t batch = out.numel() / std::max<int64_t>(m * m, 1);
  void* data = out.mutable_data_ptr();
  switch (out.element_size()) {
    case 2:
      return mirror_lower_to_upper(static_cast<uint16_t*>(data), batch, m);
    case 4:
      return mirror_lower_to_upper(static_cast<uint32_t*>(data), batch, m);
    case 8:
      return mirror_lower_to_upper(static_cast<uint64_t*>(data), batch, m);
    default:
      TORCH_INTERNAL_ASSERT(false, "symmetric_gram_: unexpected element size ", out.element_size());
  }
}

// A GEMM operand needs unit stride along one of its two dimensions; anything else is copied once here rather than
// by every tile's GEMM.
at::Tensor with_gemm_strides(const at::Tensor& X) {
  const bool row_major = X.stride(-1) == 1 && X.stride(-2) >= std::max<int64_t>(1, X.size(-1));
  const bool column_major = X.stride(-2) == 1 && X.stride(-1) >= std::max<int64_t>(1, X.size(-2));
  return row_major || column_major ? X : X.contiguous();
}

}  // namespace

void symmetric_gram_cpu(at::Tensor& out, const at::Tensor& X, const std::optional<at::Tensor>& C, double alpha,
                        double beta) {
  if (out.numel() == 0) {
    return;
  }
  const at::Tensor X_gemm = with_gemm_strides(X);
  const int64_t m = X.size(-2);
  if (X.dim() == 2) {
    lower_gram(out, GramTerms{X_gemm, C, alpha, beta});
  } else if (m <= kPanelRows) {
    // Matrices of one panel gain nothing from tiling: one batched GEMM lets torch spread the batch over the threads.
    at::baddbmm_out(out, C.has_value() ? *C : out, X_gemm, X_gemm.mT(), C.has_value() ? beta : 0.0, alpha);
  } else {
    for (int64_t index = 0; index < X.size(0); ++index) {
      const std::optional<at::Tensor> C_matrix = C.has_value() ? std::optional(C->select(0, index)) : std::nullopt;
      lower_gram(out.select(0, index), GramTerms{X_gemm.select(0, index), C_matrix, alpha, beta});
    }
  }
  mirror_lower_to_upper(out);
}
