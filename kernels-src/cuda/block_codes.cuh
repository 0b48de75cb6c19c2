#pragma once
// What the kernels that write int8 codes with one float32 scale per block share (muon_momentum_rounded.cu,
// moment_codes.cu): where each entry's random bits come from, and the block's largest magnitude taken over a warp or a
// CTA.
#include <cstdint>

namespace muon_cuda {

constexpr int kWarp = 32;

// torch.amax's max: a NaN wins (the scale is then NaN, and the block's codes 0, as torch.where gives them).
__device__ __forceinline__ float max_with_nan(float a, float b) { return (a > b || a != a) ? a : b; }

// The largest of x over a warp, returned to every lane; every lane must call it.
__device__ __forceinline__ float warp_max(float x) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    x = max_with_nan(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

// The largest of x over a CTA of kCtaThreads threads (whole warps), returned to every thread. Every thread of the CTA
// must call it (it synchronizes); `partial` holds kCtaThreads / kWarp values and is free again when it returns.
template <int kCtaThreads>
__device__ __forceinline__ float block_max(float x, float* partial) {
  static_assert(kCtaThreads % kWarp == 0 && kCtaThreads <= 1024, "a CTA of whole warps");
  x = warp_max(x);
  if (threadIdx.x % kWarp == 0) {
    partial[threadIdx.x / kWarp] = x;
  }
  __syncthreads();
  float result = partial[0];
  for (int warp = 1; warp < kCtaThreads / kWarp; ++warp) {
    result = max_with_nan(result, partial[warp]);
  }
  __syncthreads();  // every thread has read `partial` before the next call writes it
  return result;
}

}  // namespace muon_cuda
