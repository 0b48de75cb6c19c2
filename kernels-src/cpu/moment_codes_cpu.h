#pragma once
// Moments as int8 codes with one scale per block, shared by the CPU momentum op, `load_moment_`/`store_moment_` and
// `adamw_rounded_`: where each block lies, where each entry's random bits come from, the codes' values, and the
// encoding of one block.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>

#include "../common/stochastic_rounding.h"
#include "torch_binding.h"

namespace muon_cpu {

// The codes' geometry: lines of `line` entries (the last dim), each cut into blocks of kRoundedBlock, the last one
// maybe partial; block b's scale is the b-th of the contiguous scales.
struct Blocks {
  int64_t line;
  int64_t per_line;

  Blocks(const at::Tensor& stored, const at::Tensor& scales) : line(stored.size(-1)), per_line(scales.size(-1)) {}

  int64_t first(int64_t block) const { return block / per_line * line + block % per_line * kRoundedBlock; }
  int64_t length(int64_t block) const { return std::min(kRoundedBlock, line - block % per_line * kRoundedBlock); }
};

// Where the random bits of entry j come from: its position in the whole tensor and the count of rounded writes.
struct Salt {
  int64_t rounding_count;
  muon_rounding::EntryPositions positions;

  // The bits of entries [first, first + length), length <= kRoundedBlock: one loop per source of the position, and
  // one per run of a shard's row, as a choice or a division inside the loop would keep it from vectorizing.
  C10_ALWAYS_INLINE void fill(uint32_t* __restrict__ bits, int64_t first, int64_t length) const {
    const int64_t start = positions.offset + first;
    if (positions.rows == nullptr) {
      for (int64_t t = 0; t < length; ++t) {
        bits[t] = muon_rounding::random_bits(start + t, rounding_count);
      }
      return;
    }
    int64_t row = start / positions.column_count, column = start % positions.column_count;
    for (int64_t t = 0; t < length; column = 0, ++row) {
      const int64_t run = std::min(length - t, positions.column_count - column);
      const int64_t row_position = positions.rows[row];
      const int64_t* __restrict__ columns = positions.columns + column;
      for (int64_t u = 0; u < run; ++u) {
        bits[t + u] = muon_rounding::random_bits(row_position + columns[u], rounding_count);
      }
      t += run;
    }
  }
};

// The value of each of the 256 codes, indexed by the code's bits.
struct CodeValues {
  float of[256];

  explicit CodeValues(MomentCode kind) {
    for (int bits = 0; bits < 256; ++bits) {
      const auto code = static_cast<uint8_t>(bits);
      of[bits] = kind == MomentCode::kLinear ? static_cast<float>(static_cast<int8_t>(code))
                                             : muon_rounding::e4m3_value(code);
    }
  }
};

// Codes [first, first + length) <- values[0, length) (already in coded form: the square root for kE4m3Root), with
// the block's new scale: its largest magnitude over the largest code, each rounded with its random bits[0, length).
// One loop per stage, so each vectorizes.
C10_ALWAYS_INLINE void store_block(int8_t* __restrict__ codes, float* __restrict__ scale,
                                   const float* __restrict__ values, int64_t first, int64_t length, MomentCode kind,
                                   const uint32_t* __restrict__ bits) {
  // The largest magnitude as the largest of the magnitudes' bit patterns, which order as the values do, a NaN above
  // all (so it wins, as in torch.amax): an integer max, which vectorizes where a float max with NaNs does not.
  uint32_t largest_bits = 0;
  for (int64_t t = 0; t < length; ++t) {
    largest_bits = std::max(largest_bits, muon_rounding::float_bits(values[t]) & 0x7FFFFFFFu);
  }
  const float largest = muon_rounding::finite_largest(muon_rounding::bits_float(largest_bits));
  int8_t* __restrict__ block = codes + first;
  if (kind == MomentCode::kLinear) {
    const float new_scale = largest / muon_rounding::kLinearMax;
    for (int64_t t = 0; t < length; ++t) {
      block[t] = muon_rounding::linear_code(values[t], new_scale, bits[t]);
    }
    *scale = new_scale;
    return;
  }
  const float new_scale = largest / muon_rounding::kE4m3Max;
  const bool scaled = new_scale > 0.0f;
  const float divisor = scaled ? new_scale : 1.0f;
  for (int64_t t = 0; t < length; ++t) {
    block[t] = static_cast<int8_t>(muon_rounding::e4m3_code(scaled ? values[t] / divisor : 0.0f, bits[t]));
  }
  *scale = new_scale;
}

// store_block with the block's random bits drawn from `salt`.
C10_ALWAYS_INLINE void store_block(int8_t* __restrict__ codes, float* __restrict__ scale,
                                   const float* __restrict__ values, int64_t first, int64_t length, MomentCode kind,
                                   const Salt& salt) {
  uint32_t bits[kRoundedBlock];
  salt.fill(bits, first, length);
  store_block(codes, scale, values, first, length, kind, bits);
}

}  // namespace muon_cpu
