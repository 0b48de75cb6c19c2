#pragma once
// Whether a tensor's elements are all finite, in one parallel pass at memory speed: the check that gates Muon's
// momentum step and AdamW's (the `finite_flags_` op).
#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <ATen/Parallel.h>

#include "vector_clones.h"

namespace muon_cpu {

// Elements per task: the passes are memory-bound, so smaller chunks cost more in scheduling than they gain.
constexpr int64_t kGrainSize = 32768;

// float and double: x * 0 is +-0 for finite x and NaN for NaN or +-Inf, and a sum keeps the NaN.
template <typename value_t>
struct ProductCheck {
  using partial_t = value_t;
  static partial_t of(const value_t* value) { return *value * value_t(0); }
  static partial_t combine(partial_t a, partial_t b) { return a + b; }
  static bool nonfinite(partial_t total) { return !(total == value_t(0)); }
};

// bfloat16 and half, read as bits: the exponent field is all ones exactly for NaN and +-Inf, and +Inf's bits are
// that field alone. Converting to float first kept the loop scalar (half: 10x slower).
template <typename value_t>
struct ExponentCheck {
  using partial_t = int16_t;
  static constexpr partial_t kExponent = std::bit_cast<partial_t>(std::numeric_limits<value_t>::infinity());
  static partial_t of(const value_t* value) {
    partial_t bits;
    std::memcpy(&bits, value, sizeof bits);
    return static_cast<partial_t>(bits & kExponent);
  }
  static partial_t combine(partial_t a, partial_t b) { return std::max(a, b); }
  static bool nonfinite(partial_t total) { return total == kExponent; }
};

template <typename value_t>
using FiniteCheck =
    std::conditional_t<std::is_floating_point_v<value_t>, ProductCheck<value_t>, ExponentCheck<value_t>>;

// The range is read as four parts at once, into 256 bytes of partial results (eight AVX2 vectors, four AVX-512
// ones). With one chain of partial results the loads waited on it (float32 at two thirds of torch.sum's bandwidth);
// with one part, 16-bit tensors took 1.3x as long (2-core Xeon, 154 MB tensors).
template <typename value_t>
MUON_VECTOR_CLONES bool any_nonfinite(const value_t* __restrict__ values, int64_t count) {
  using check = FiniteCheck<value_t>;
  constexpr int lanes = 256 / sizeof(value_t);
  constexpr int streams = 4;
  typename check::partial_t partials[lanes] = {};
  const int64_t part = count / (streams * lanes) * lanes;
  for (int64_t j = 0; j < part; j += lanes) {
    for (int s = 0; s < streams; ++s) {
      for (int k = 0; k < lanes; ++k) partials[k] = check::combine(partials[k], check::of(values + s * part + j + k));
    }
  }
  typename check::partial_t total{};
  for (int k = 0; k < lanes; ++k) total = check::combine(total, partials[k]);
  for (int64_t j = streams * part; j < count; ++j) total = check::combine(total, check::of(values + j));
  return check::nonfinite(total);
}

template <typename value_t>
bool all_finite(const value_t* values, int64_t numel) {
  std::atomic<bool> finite{true};
  at::parallel_for(0, numel, kGrainSize, [&](int64_t begin, int64_t end) {
    if (any_nonfinite(values + begin, end - begin)) {
      finite.store(false, std::memory_order_relaxed);
    }
  });
  return finite.load(std::memory_order_relaxed);
}

}  // namespace muon_cpu
