#pragma once
// The element math the CPU momentum and update kernels share: torch.lerp's formula, the loads and stores that widen
// from and round to a dtype, and how far ahead a loop streaming from memory prefetches.
#include <cstdint>

#include <ATen/OpMathType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/bit_cast.h>
#include <c10/macros/Macros.h>

namespace muon_cpu {

// How far ahead a loop streaming from memory prefetches each stream. A 38M-entry float32 AdamW step (2-core Xeon):
// 21.0 ms at 2 KiB, 21.3 at 1 KiB, 21.4 at 4 KiB, 21.5 at 8 KiB, 22.9 with the hardware's prefetchers alone, 28 with a
// burst of prefetches for each 4 KiB block, in runs where torch's fused AdamW kernel took 24.1-25.2 ms. AdaMuon's
// normalization of a (12, 3072, 768) bf16 update: 8.7 ms at 2 KiB, 9.4 at 1 KiB, 8.9 at 4 KiB, 30 with the hardware's
// alone; Muon's momentum step into it from float32: 14.6 ms against 17.7; the update's last write: 6.8 against 7.5.
constexpr int64_t kPrefetchBytes = 2048;

// `count` entries from `values` on asked for, for writing where kWrite: a block loop's call for the block
// kPrefetchBytes or so ahead. Its streams are read in runs of a block, between which the hardware's prefetchers lose
// them (Muon's momentum step on 12 3072 x 768 matrices with bf16 / int8 state: 15.7 / 21.1 ms against 25.8 / 23.8).
template <bool kWrite, typename value_t>
C10_ALWAYS_INLINE void prefetch_entries(const value_t* values, int64_t count) {
  const auto* bytes = reinterpret_cast<const char*>(values);
  for (int64_t byte = 0; byte < count * static_cast<int64_t>(sizeof(value_t)); byte += 64) {
    __builtin_prefetch(bytes + byte, kWrite);
  }
}

// entry(j) for each j in [0, count), the stream it reads and the streams it writes prefetched kPrefetchBytes ahead,
// once per cache line of line_t (the widest of their dtypes: a narrower stream's line is asked for more than once,
// which costs little). The tail, within kPrefetchBytes of the end, runs without.
template <typename line_t, typename Entry, typename read_t, typename... written_t>
C10_ALWAYS_INLINE void for_each_prefetched(int64_t count, const Entry& entry, const read_t* read,
                                           const written_t*... written) {
  constexpr int64_t line = 64 / static_cast<int64_t>(sizeof(line_t));
  constexpr int64_t ahead = kPrefetchBytes / static_cast<int64_t>(sizeof(line_t));
  const auto bytes_ahead = [](const auto* stream, int64_t first) {
    return reinterpret_cast<const char*>(stream + first) + kPrefetchBytes;
  };
  int64_t first = 0;
  for (; first + ahead + line <= count; first += line) {
    __builtin_prefetch(bytes_ahead(read, first));
    (__builtin_prefetch(bytes_ahead(written, first), 1), ...);
    for (int64_t j = first; j < first + line; ++j) entry(j);
  }
  for (int64_t j = first; j < count; ++j) entry(j);
}

// torch.lerp's formula, weight < 0.5 ? start + weight * (end - start) : end - (end - start) * (1 - weight), with
// the weight rounded to opmath_t first as torch does (for weight in [0.5, 1], 1 - weight and weight - 1 are both
// exact), but with the choice made once per call rather than per element, so the loops vectorize. The AVX2 and
// AVX-512 clones may fuse the multiply-add, as torch's own vectorized lerp does: one rounding fewer.
template <typename opmath_t>
struct Lerp {
  explicit Lerp(double weight)
      : from_start(static_cast<opmath_t>(weight) < opmath_t(0.5)),
        coefficient(from_start ? static_cast<opmath_t>(weight) : static_cast<opmath_t>(weight) - opmath_t(1)) {}

  opmath_t operator()(opmath_t start, opmath_t end) const {
    return (from_start ? start : end) + coefficient * (end - start);
  }

  bool from_start;
  opmath_t coefficient;
};

// value in its opmath type.
template <typename T>
C10_ALWAYS_INLINE at::opmath_type<T> widen(T value) {
  return static_cast<at::opmath_type<T>>(value);
}

// bfloat16 from its raw bits: c10::BFloat16's conversion goes through memcpy, which GCC does not vectorize.
template <>
C10_ALWAYS_INLINE float widen<c10::BFloat16>(c10::BFloat16 value) {
  return c10::bit_cast<float>(static_cast<uint32_t>(value.x) << 16);
}

// Rounds value to T, stores it, and returns the stored value widened back (what a later reader of *dst sees).
template <typename T, typename opmath_t>
C10_ALWAYS_INLINE opmath_t store(T* dst, opmath_t value) {
  *dst = static_cast<T>(value);
  return static_cast<opmath_t>(*dst);
}

// bfloat16 stores its raw bits: assigning the c10 struct is a struct copy, which GCC does not vectorize, and
// c10::BFloat16's rounding returns early for NaN, a branch that also blocks it. This is the same
// round-to-nearest-even with NaN as a select (4x faster loops, measured).
template <>
C10_ALWAYS_INLINE float store<c10::BFloat16, float>(c10::BFloat16* dst, float value) {
  const uint32_t bits = c10::bit_cast<uint32_t>(value);
  const uint32_t rounded = value != value ? 0x7FC0u : (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  dst->x = static_cast<uint16_t>(rounded);
  return c10::bit_cast<float>(rounded << 16);
}

}  // namespace muon_cpu
