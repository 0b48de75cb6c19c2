#pragma once
// Stochastic rounding of the momentum for the CPU and CUDA kernels of `muon_momentum_rounded_`, bit for bit what
// torch-ext/optimizer/state_precision.py computes with tensor ops (its docstring says why each choice was made).
// Plain integer and float arithmetic only, so one definition serves the host compiler and nvcc.
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MUON_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MUON_HOST_DEVICE inline
#endif

namespace muon_rounding {

constexpr uint32_t kGolden = 0x9E3779B9u;  // 2^32 / golden ratio: consecutive counts land far apart
constexpr float kLinearMax = 127.0f;       // int8 linear codes run -127..127
constexpr float kE4m3Max = 448.0f;         // float8 e4m3's largest value
constexpr float kE4m3MinNormal = 0x1p-6f;  // below it, e4m3 values are evenly spaced, 2^-9 apart
constexpr float kFloatMax = 0x1.fffffep127f;

// A block's largest magnitude as its scale is formed from: an infinite one (a second moment whose square overflowed
// float32) as float32's largest, so the block keeps a finite scale, that entry the largest code and the others their
// codes, where an infinite scale decoded them as 0 * inf = NaN; a NaN stays NaN.
MUON_HOST_DEVICE float finite_largest(float largest) { return largest == INFINITY ? kFloatMax : largest; }

// MurmurHash3's 32-bit finalizer: every input bit flips about half of the output bits.
MUON_HOST_DEVICE uint32_t mix(uint32_t word) {
  word ^= word >> 16;
  word *= 0x85EBCA6Bu;
  word ^= word >> 13;
  word *= 0xC2B2AE35u;
  return word ^ (word >> 16);
}

// 32 random bits of an entry from its index in the whole tensor (low 32 bits) and the tensor's count of rounded writes.
MUON_HOST_DEVICE uint32_t random_bits(int64_t position, int64_t count) {
  return mix(mix(static_cast<uint32_t>(position)) ^ (static_cast<uint32_t>(count) * kGolden));
}

// Where each entry of a write lies in the whole tensor: the position its random bits are hashed from, which makes a
// rounding the same whichever way the tensor is split. Entry j of a write that starts `offset` entries into a shard,
// with (r, c) = divmod(offset + j, column_count), lies at rows[r] + columns[c]: two short vectors (a shard's rows and
// columns, each dim's global index times its stride) where a shard-sized int64 tensor took 8 bytes per entry. Without
// them (a whole tensor), at offset + j.
struct EntryPositions {
  const int64_t* rows;  // null: offset + j
  const int64_t* columns;
  int64_t column_count;
  int64_t offset;

  MUON_HOST_DEVICE int64_t operator()(int64_t j) const {
    const int64_t k = offset + j;
    if (rows == nullptr) {
      return k;
    }
#if defined(__CUDA_ARCH__)
    if (((k | column_count) >> 32) == 0) {  // a 32-bit division: a fraction of the 64-bit one's instructions
      const auto row = static_cast<uint32_t>(k) / static_cast<uint32_t>(column_count);
      return rows[row] + columns[static_cast<uint32_t>(k) - row * static_cast<uint32_t>(column_count)];
    }
#endif
    return rows[k / column_count] + columns[k % column_count];
  }
};

// A backend's EntryPositions from its optional int64 tensors (both given, contiguous, or neither), host only.
template <typename OptionalTensor>
EntryPositions entry_positions(const OptionalTensor& rows, const OptionalTensor& columns, int64_t offset) {
  if (!rows.has_value()) {
    return {nullptr, nullptr, 1, offset};
  }
  return {rows->template const_data_ptr<int64_t>(), columns->template const_data_ptr<int64_t>(), columns->numel(),
          offset};
}

// Uniform in [0, 1) from the upper 24 of the 32 bits: exact in float. Converted as a signed integer (it fits), which
// x86 vectorizes before AVX-512; an unsigned one kept every CPU loop around it scalar.
MUON_HOST_DEVICE float fraction(uint32_t bits) {
  return static_cast<float>(static_cast<int32_t>(bits >> 8)) * 0x1p-24f;
}

MUON_HOST_DEVICE uint32_t float_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  return __builtin_bit_cast(uint32_t, value);  // not memcpy, which keeps GCC from vectorizing the loops around it
#endif
}

MUON_HOST_DEVICE float bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  return __builtin_bit_cast(float, bits);
#endif
}

// The bfloat16 bits of `value` rounded down or up in magnitude at random: random bits added to the 16 bits bfloat16
// drops, then truncated. NaN gives bfloat16's canonical NaN, as torch's conversion does.
MUON_HOST_DEVICE uint16_t bfloat16_bits_rounded(float value, uint32_t bits) {
  const uint32_t rounded = (float_bits(value) + (bits & 0xFFFFu)) >> 16;
  return value != value ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

// An int8 linear code of `value` under `scale` (the block's largest magnitude / 127): down or up at random, up with
// probability equal to the fraction. A block of zeros has scale 0 and codes 0.
MUON_HOST_DEVICE int8_t linear_code(float value, float scale, uint32_t bits) {
  const float scaled = scale > 0.0f ? value / scale : 0.0f;
  const float code = floorf(scaled + fraction(bits));
  const float clamped = code < -kLinearMax ? -kLinearMax : code > kLinearMax ? kLinearMax : code;
  return static_cast<int8_t>(static_cast<int32_t>(clamped));
}

// `scaled` (within +-448) rounded at random to a float8 e4m3 value, as its code: random bits added to the 20 mantissa
// bits e4m3 drops, then truncated; below the smallest normal, in fixed point with the same bits (codes 0..8, where 8
// is the smallest normal, reached by rounding up). Selects, not branches, so CPU loops over it vectorize.
MUON_HOST_DEVICE uint8_t e4m3_code(float scaled, uint32_t bits) {
  const float magnitude = fabsf(scaled);
  const uint32_t sign = (float_bits(scaled) >> 24) & 0x80u;
  const auto fixed = static_cast<uint32_t>(static_cast<int32_t>(floorf(magnitude * 512.0f + fraction(bits))));
  const float truncated = bits_float((float_bits(magnitude) + (bits & 0xFFFFFu)) & ~0xFFFFFu);
  const uint32_t pattern = float_bits(truncated < kE4m3Max ? truncated : kE4m3Max);
  const uint32_t normal = (((pattern >> 23) - 127u + 7u) << 3) | ((pattern >> 20) & 7u);
  const uint32_t code = scaled != scaled ? 0x7Fu : magnitude < kE4m3MinNormal ? fixed : normal;
  return static_cast<uint8_t>(code | sign);
}

// The value of a float8 e4m3 code.
MUON_HOST_DEVICE float e4m3_value(uint8_t code) {
  const uint32_t exponent = (code >> 3) & 15u;
  const uint32_t mantissa = code & 7u;
  float magnitude;
  if ((code & 0x7Fu) == 0x7Fu) {
    magnitude = bits_float(0x7FC00000u);
  } else if (exponent == 0u) {
    magnitude = static_cast<float>(mantissa) * 0x1p-9f;
  } else {
    magnitude = bits_float(((exponent - 7u + 127u) << 23) | (mantissa << 20));
  }
  return (code & 0x80u) != 0u ? -magnitude : magnitude;
}

}  // namespace muon_rounding
