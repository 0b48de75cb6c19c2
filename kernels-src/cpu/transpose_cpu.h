#pragma once
// Transposition in registers, and the tiles it moves: what the CPU kernels that read one matrix's rows as another's
// columns share (the update of a tall matrix, stored transposed; the mirrored triangle of a symmetric product).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/macros/Macros.h>

namespace muon_cpu {

// Eight vectors of eight values, transposed by three rounds of interleaving (the classic AVX sequence), in vector
// extensions so that each CPU clone of the caller gets its own shuffles.
template <typename value_t>
struct Lanes8 {
  typedef value_t type __attribute__((vector_size(8 * sizeof(value_t))));
};

// target[r * target_stride + c] = source[c * source_stride + r] for r, c in [0, 8). All of the source is read
// before the target is written.
template <typename value_t>
C10_ALWAYS_INLINE void transpose8(const value_t* source, int64_t source_stride, value_t* target,
                                  int64_t target_stride) {
  using lanes_t = typename Lanes8<value_t>::type;
  lanes_t x[8], y[8], z[8];
  for (int k = 0; k < 8; ++k) std::memcpy(&x[k], source + k * source_stride, sizeof(lanes_t));
  for (int k = 0; k < 8; k += 2) {
    y[k] = __builtin_shufflevector(x[k], x[k + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    y[k + 1] = __builtin_shufflevector(x[k], x[k + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int k = 0; k < 8; k += 4) {
    for (int h = 0; h < 2; ++h) {
      z[k + h] = __builtin_shufflevector(y[k + h], y[k + h + 2], 0, 1, 8, 9, 4, 5, 12, 13);
      z[k + h + 2] = __builtin_shufflevector(y[k + h], y[k + h + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    }
  }
  constexpr int kRowOf[8] = {0, 2, 1, 3, 4, 6, 5, 7};  // where each output vector lands after the interleaving
  for (int h = 0; h < 4; ++h) {
    const lanes_t low = __builtin_shufflevector(z[h], z[h + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    const lanes_t high = __builtin_shufflevector(z[h], z[h + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    std::memcpy(target + kRowOf[h] * target_stride, &low, sizeof(lanes_t));
    std::memcpy(target + kRowOf[h + 4] * target_stride, &high, sizeof(lanes_t));
  }
}

// Tiles of a matrix stored transposed (a tall matrix's Newton-Schulz result, computed on its transpose), which the
// kernels read along the stored rows, transpose in registers, and use along the parameter's rows, so that both sides
// stream through memory.
constexpr int64_t kTile = 64;

struct TransposedTiles {
  int64_t rows;  // of the parameter's matrices; the update holds each matrix as (cols, rows), contiguous
  int64_t cols;
  int64_t row_tiles;
  int64_t col_tiles;

  TransposedTiles(int64_t rows, int64_t cols)
      : rows(rows), cols(cols), row_tiles((rows + kTile - 1) / kTile), col_tiles((cols + kTile - 1) / kTile) {}

  int64_t per_matrix() const { return row_tiles * col_tiles; }
};

// Where tile number `tile` (counted over every matrix of the stack, row tiles outer) starts, and how much of it lies
// inside its matrix.
struct TilePlace {
  int64_t matrix_offset;  // of its matrix, in entries
  int64_t first_row;
  int64_t first_col;
  int64_t row_count;
  int64_t col_count;

  TilePlace(const TransposedTiles& tiles, int64_t tile)
      : matrix_offset(tile / tiles.per_matrix() * tiles.rows * tiles.cols),
        first_row(tile % tiles.per_matrix() / tiles.col_tiles * kTile),
        first_col(tile % tiles.per_matrix() % tiles.col_tiles * kTile),
        row_count(std::min(kTile, tiles.rows - first_row)),
        col_count(std::min(kTile, tiles.cols - first_col)) {}

  bool partial() const { return row_count < kTile || col_count < kTile; }
};

// A kTile x kTile block transposed, 8 x 8 at a time; entries moved as raw bits of their width, so any dtype (the
// 16-bit ones are structs, which vector extensions do not take) shares one transposition.
template <typename value_t>
C10_ALWAYS_INLINE void transpose_tile(const value_t (&source)[kTile][kTile], value_t (&target)[kTile][kTile]) {
  using bits_t = std::conditional_t<sizeof(value_t) == 2, uint16_t,
                                    std::conditional_t<sizeof(value_t) == 4, uint32_t, uint64_t>>;
  const auto* from = reinterpret_cast<const bits_t*>(&source[0][0]);
  auto* to = reinterpret_cast<bits_t*>(&target[0][0]);
  for (int64_t i = 0; i < kTile; i += 8) {
    for (int64_t j = 0; j < kTile; j += 8) {
      transpose8(from + i * kTile + j, kTile, to + j * kTile + i, kTile);
    }
  }
}

}  // namespace muon_cpu
