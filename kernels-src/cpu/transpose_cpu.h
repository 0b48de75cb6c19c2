#pragma once
// An 8 x 8 block transposed in registers: what the CPU kernels that read one matrix's rows as another's columns share
// (the update of a tall matrix, stored transposed; the mirrored triangle of a symmetric product).
#include <cstdint>
#include <cstring>

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

}  // namespace muon_cpu
