// A moment kept in fewer bytes, read into and written from float32 on the GPU (`load_moment_`, `store_moment_`): per
// entry for bfloat16 and for reading codes, one CTA per block of codes sharing a scale for writing them (the block's
// largest magnitude sets it). Bit for bit what kernels-src/cpu/moment_codes_cpu.cpp computes: the rounding and the
// codes are ../common/stochastic_rounding.h, shared with it. Every float operation that could be contracted or
// approximated is spelled as its IEEE intrinsic.
#include <algorithm>
#include <cstdint>

#include "../common/stochastic_rounding.h"
#include "block_codes.cuh"
#include "elementwise.cuh"

#include "moment_codes_launch.h"

namespace muon_cuda {
namespace {

using muon_rounding::EntryPositions;

constexpr int kBlockThreads = static_cast<int>(kMomentBlock);  // one thread per entry of an int8 block

template <Int8Code kCode>
__device__ __forceinline__ float code_value(int8_t code) {
  if constexpr (kCode == Int8Code::kLinear) {
    return static_cast<float>(code);
  } else {
    return muon_rounding::e4m3_value(static_cast<uint8_t>(code));
  }
}

__global__ void load_bfloat16_kernel(float* __restrict__ out, const uint16_t* __restrict__ stored, int64_t numel) {
  for (int64_t j = first_index(); j < numel; j += grid_stride()) {
    out[j] = muon_rounding::bits_float(static_cast<uint32_t>(stored[j]) << 16);
  }
}

template <Int8Code kCode>
__global__ void load_int8_kernel(float* __restrict__ out, const int8_t* __restrict__ codes,
                                 const float* __restrict__ scales, int64_t numel, int64_t line_length,
                                 int64_t blocks_per_line) {
  for (int64_t j = first_index(); j < numel; j += grid_stride()) {
    const int64_t line = j / line_length;
    const int64_t block = line * blocks_per_line + (j - line * line_length) / kMomentBlock;
    const float value = __fmul_rn(code_value<kCode>(codes[j]), scales[block]);
    out[j] = kCode == Int8Code::kE4m3Root ? __fmul_rn(value, value) : value;
  }
}

__global__ void store_bfloat16_kernel(uint16_t* __restrict__ stored, const float* __restrict__ values, int64_t numel,
                                      MomentWrite write) {
  if (*write.taken == 0.0f) {
    return;
  }
  const EntryPositions position = write.positions;
  const int64_t rounding_count = *write.rounding_count;
  for (int64_t j = first_index(); j < numel; j += grid_stride()) {
    const uint32_t bits = muon_rounding::random_bits(position(j), rounding_count);
    stored[j] = muon_rounding::bfloat16_bits_rounded(values[j], bits);
  }
}

// One CTA of kBlockThreads threads per int8 block (grid-stride over the blocks): thread t takes column t of it.
template <Int8Code kCode>
__global__ void __launch_bounds__(kBlockThreads)
    store_int8_kernel(int8_t* __restrict__ codes, float* __restrict__ scales, const float* __restrict__ values,
                      MomentWrite write, int64_t line_length, int64_t blocks_per_line, int64_t block_count) {
  if (*write.taken == 0.0f) {  // the same for the whole grid: no thread is left waiting at a barrier
    return;
  }
  __shared__ float partial[kBlockThreads / kWarp];
  const EntryPositions position = write.positions;
  const int64_t rounding_count = *write.rounding_count;
  constexpr float kLargestCode = kCode == Int8Code::kLinear ? muon_rounding::kLinearMax : muon_rounding::kE4m3Max;
  for (int64_t block = blockIdx.x; block < block_count; block += gridDim.x) {
    const int64_t line = block / blocks_per_line;
    const int64_t column = (block - line * blocks_per_line) * kMomentBlock + threadIdx.x;
    const bool inside = column < line_length;  // the last block of a line may be partial
    const int64_t j = line * line_length + column;
    float coded = 0.0f;  // past the line's end: 0, which leaves the max alone
    if (inside) {
      coded = kCode == Int8Code::kE4m3Root ? __fsqrt_rn(values[j]) : values[j];
    }
    // Every thread reaches the barriers inside, those past the line's end too.
    const float scale = __fdiv_rn(muon_rounding::finite_largest(block_max<kBlockThreads>(fabsf(coded), partial)),
                                  kLargestCode);
    if (inside) {
      const uint32_t bits = muon_rounding::random_bits(position(j), rounding_count);
      if constexpr (kCode == Int8Code::kLinear) {
        codes[j] = muon_rounding::linear_code(coded, scale, bits);
      } else {
        codes[j] = static_cast<int8_t>(muon_rounding::e4m3_code(scale > 0.0f ? __fdiv_rn(coded, scale) : 0.0f, bits));
      }
    }
    if (threadIdx.x == 0) {
      scales[block] = scale;
    }
  }
}

template <Int8Code kCode>
struct CodeTag {
  static constexpr Int8Code value = kCode;
};

// Calls f(tag) with tag.value the code as a compile-time constant.
template <typename F>
void dispatch_code(Int8Code code, F&& f) {
  switch (code) {
    case Int8Code::kLinear:
      return f(CodeTag<Int8Code::kLinear>{});
    case Int8Code::kE4m3:
      return f(CodeTag<Int8Code::kE4m3>{});
    case Int8Code::kE4m3Root:
      return f(CodeTag<Int8Code::kE4m3Root>{});
  }
}

int64_t blocks_per_line_of(int64_t line_length) { return (line_length + kMomentBlock - 1) / kMomentBlock; }

}  // namespace

void launch_load_moment_bfloat16(float* out, const uint16_t* stored, int64_t numel, cudaStream_t stream) {
  if (numel == 0) {
    return;
  }
  load_bfloat16_kernel<<<blocks_for(numel), kThreads, 0, stream>>>(out, stored, numel);
}

void launch_load_moment_int8(float* out, const int8_t* codes, const float* scales, int64_t numel, int64_t line_length,
                             Int8Code code, cudaStream_t stream) {
  if (numel == 0) {
    return;
  }
  dispatch_code(code, [&](auto tag) {
    load_int8_kernel<decltype(tag)::value><<<blocks_for(numel), kThreads, 0, stream>>>(
        out, codes, scales, numel, line_length, blocks_per_line_of(line_length));
  });
}

void launch_store_moment_bfloat16(uint16_t* stored, const float* values, int64_t numel, const MomentWrite& write,
                                  cudaStream_t stream) {
  if (numel == 0) {
    return;
  }
  store_bfloat16_kernel<<<blocks_for(numel), kThreads, 0, stream>>>(stored, values, numel, write);
}

void launch_store_moment_int8(int8_t* codes, float* scales, const float* values, int64_t numel, int64_t line_length,
                              Int8Code code, const MomentWrite& write, cudaStream_t stream) {
  if (numel == 0) {
    return;
  }
  const int64_t blocks_per_line = blocks_per_line_of(line_length);
  const int64_t block_count = numel / line_length * blocks_per_line;
  const auto grid = static_cast<unsigned int>(std::min(block_count, kMaxBlocks));
  dispatch_code(code, [&](auto tag) {
    store_int8_kernel<decltype(tag)::value><<<grid, kBlockThreads, 0, stream>>>(
        codes, scales, values, write, line_length, blocks_per_line, block_count);
  });
}

}  // namespace muon_cuda
