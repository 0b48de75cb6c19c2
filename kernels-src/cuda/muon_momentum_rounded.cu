// Muon's momentum step on momentum stored in fewer bytes (bfloat16, or int8 codes with a float32 scale per block of
// kQuantBlock entries along the last dim): stepped in float32 from the stored values, the update written from that
// float32 value, the new momentum stored back rounded at random with bits hashed from each entry's position and the
// tensor's rounding count. Bit for bit what torch-ext/optimizer/state_precision.py computes with tensor ops: the
// rounding itself is ../common/stochastic_rounding.h, shared with the CPU kernel.
#include <algorithm>
#include <cstdint>

#include "../common/stochastic_rounding.h"
#include "block_codes.cuh"
#include "elementwise.cuh"

#include "muon_momentum_rounded_launch.h"

namespace muon_cuda {
namespace {

using muon_rounding::EntryPositions;

constexpr int kQuantCtaWarps = 8;  // int8 blocks a CTA takes at a time, a warp each
constexpr int kQuantCtaThreads = kQuantCtaWarps * kWarp;
constexpr int kQuantLaneEntries = static_cast<int>(kQuantBlock) / kWarp;
static_assert(kQuantBlock % kWarp == 0, "whole entries per lane");

// A skipped step (a non-finite gradient): the update is zero, the stored momentum untouched.
template <typename U>
__device__ void zero_update(U* __restrict__ update, int64_t numel) {
  for (int64_t j = first_index(); j < numel; j += grid_stride()) {
    update[j] = Store<U>::from(0.0f);
  }
}

template <typename G, typename U>
__global__ void rounded_bfloat16_kernel(__nv_bfloat16* __restrict__ buffer, const G* __restrict__ grad,
                                        U* __restrict__ update, EntryPositions position,
                                        const int64_t* __restrict__ count,
                                        const float* __restrict__ flag, int64_t numel, float grad_weight,
                                        float buffer_weight, bool nesterov) {
  if (*flag == 0.0f) {
    zero_update(update, numel);
    return;
  }
  const int64_t rounding_count = *count;
  for (int64_t j = first_index(); j < numel; j += grid_stride()) {
    const uint32_t bits = muon_rounding::random_bits(position(j), rounding_count);
    const float g = static_cast<float>(load(grad[j]));
    const float v = lerp(load(buffer[j]), g, grad_weight);
    // The update is taken from the float32 momentum, before it is rounded into the buffer.
    update[j] = Store<U>::from(nesterov ? lerp(g, v, buffer_weight) : v);
    buffer[j] = __ushort_as_bfloat16(muon_rounding::bfloat16_bits_rounded(v, bits));
  }
}

// One warp per int8 block (grid-stride over the blocks), lane t taking entries t, t + 32, ... of it: each load and
// store of the warp covers 32 consecutive entries, and the block's largest magnitude takes shuffles only. (A CTA per
// block, a thread per entry, spent two CTA barriers on every 256 entries: 16 us a 768 x 2304 matrix on an H100,
// against 10 us for the float32 momentum's step, which moves twice the bytes.)
template <typename G, typename U>
__global__ void __launch_bounds__(kQuantCtaThreads)
    rounded_int8_kernel(int8_t* __restrict__ codes, float* __restrict__ scales, const G* __restrict__ grad,
                        U* __restrict__ update, EntryPositions position, const int64_t* __restrict__ count,
                        const float* __restrict__ flag, int64_t numel, int64_t line_length, int64_t blocks_per_line,
                        int64_t block_count, float grad_weight, float buffer_weight, bool nesterov) {
  if (*flag == 0.0f) {  // the same for the whole grid
    zero_update(update, numel);
    return;
  }
  const int64_t rounding_count = *count;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t first_block = static_cast<int64_t>(blockIdx.x) * kQuantCtaWarps + threadIdx.x / kWarp;
  for (int64_t block = first_block; block < block_count; block += static_cast<int64_t>(gridDim.x) * kQuantCtaWarps) {
    const int64_t line = block / blocks_per_line;
    const int64_t first_column = (block - line * blocks_per_line) * kQuantBlock;
    const float stored_scale = scales[block];  // read by every lane before the shuffles, written after them
    float value[kQuantLaneEntries];
    uint32_t bits[kQuantLaneEntries];
    float largest = 0.0f;  // past the line's end: the zero padding of torch's blocks, which leaves the max alone
#pragma unroll
    for (int i = 0; i < kQuantLaneEntries; ++i) {
      const int64_t column = first_column + i * kWarp + lane;
      value[i] = 0.0f;
      bits[i] = 0;
      if (column < line_length) {  // the last block of a line may be partial
        const int64_t j = line * line_length + column;
        bits[i] = muon_rounding::random_bits(position(j), rounding_count);
        // One rounded multiply, never fused into the lerp: the stored value as torch's working copy holds it.
        const float stored = __fmul_rn(static_cast<float>(codes[j]), stored_scale);
        const float g = static_cast<float>(load(grad[j]));
        value[i] = lerp(stored, g, grad_weight);
        update[j] = Store<U>::from(nesterov ? lerp(g, value[i], buffer_weight) : value[i]);
      }
      largest = max_with_nan(largest, fabsf(value[i]));
    }
    const float scale = muon_rounding::finite_largest(warp_max(largest)) / muon_rounding::kLinearMax;
#pragma unroll
    for (int i = 0; i < kQuantLaneEntries; ++i) {
      const int64_t column = first_column + i * kWarp + lane;
      if (column < line_length) {
        codes[line * line_length + column] = muon_rounding::linear_code(value[i], scale, bits[i]);
      }
    }
    if (lane == 0) {
      scales[block] = scale;
    }
  }
}

// Calls f(grad, update) with typed pointers.
template <typename F>
void dispatch_args(const RoundedMomentumArgs& args, F&& f) {
  dispatch_dtype(args.grad_dtype, [&](auto grad_tag) {
    dispatch_dtype(args.update_dtype, [&](auto update_tag) {
      using G = typename decltype(grad_tag)::type;
      using U = typename decltype(update_tag)::type;
      f(static_cast<const G*>(args.grad), static_cast<U*>(args.update));
    });
  });
}

// 1 - beta is taken in double and then rounded, as torch does with a Python-float lerp weight.
float grad_weight_of(double beta) { return static_cast<float>(1.0 - beta); }

}  // namespace

void launch_momentum_rounded_bfloat16(void* buffer, const RoundedMomentumArgs& args, cudaStream_t stream) {
  if (args.numel == 0) {
    return;
  }
  dispatch_args(args, [&](auto grad, auto update) {
    rounded_bfloat16_kernel<<<blocks_for(args.numel), kThreads, 0, stream>>>(
        static_cast<__nv_bfloat16*>(buffer), grad, update, args.positions, args.count, args.flag, args.numel,
        grad_weight_of(args.beta), static_cast<float>(args.beta), args.nesterov);
  });
}

void launch_momentum_rounded_int8(int8_t* codes, float* scales, int64_t line_length, const RoundedMomentumArgs& args,
                                  cudaStream_t stream) {
  if (args.numel == 0) {
    return;
  }
  const int64_t blocks_per_line = (line_length + kQuantBlock - 1) / kQuantBlock;
  const int64_t block_count = args.numel / line_length * blocks_per_line;
  const int64_t cta_count = (block_count + kQuantCtaWarps - 1) / kQuantCtaWarps;
  const auto grid = static_cast<unsigned int>(std::min(cta_count, kMaxBlocks));
  dispatch_args(args, [&](auto grad, auto update) {
    rounded_int8_kernel<<<grid, kQuantCtaThreads, 0, stream>>>(codes, scales, grad, update, args.positions, args.count,
                                                             args.flag, args.numel, line_length, blocks_per_line,
                                                             block_count, grad_weight_of(args.beta),
                                                             static_cast<float>(args.beta), args.nesterov);
  });
}

}  // namespace muon_cuda
