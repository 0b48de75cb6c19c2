#pragma once
// What the elementwise kernels share (muon_momentum.cu, muon_momentum_rounded.cu): launch shape, grid-stride
// indices, the dtype dispatch of the launchers, element loads and rounding stores, and torch's lerp.
#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "dtype.h"

namespace muon_cuda {

constexpr int kThreads = 256;
// Grid-stride loops cover any size; 4096 blocks of 256 threads still fill an H100 (132 SMs) several times over.
constexpr int64_t kMaxBlocks = 4096;

inline unsigned int blocks_for(int64_t numel) {
  return static_cast<unsigned int>(std::min((numel + kThreads - 1) / kThreads, kMaxBlocks));
}

template <typename T>
struct Tag {
  using type = T;
};

template <typename F>
void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(Tag<float>{});
    case DType::kFloat64:
      return f(Tag<double>{});
    case DType::kBFloat16:
      return f(Tag<__nv_bfloat16>{});
    case DType::kFloat16:
      return f(Tag<__half>{});
  }
}

__device__ __forceinline__ float load(float x) { return x; }
__device__ __forceinline__ double load(double x) { return x; }
__device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float load(__half x) { return __half2float(x); }

// Round-to-nearest-even stores from float or double (double goes straight to the 16-bit types: one rounding).
template <typename T>
struct Store;
template <>
struct Store<float> {
  template <typename S>
  __device__ static float from(S x) { return static_cast<float>(x); }
};
template <>
struct Store<double> {
  template <typename S>
  __device__ static double from(S x) { return static_cast<double>(x); }
};
template <>
struct Store<__nv_bfloat16> {
  __device__ static __nv_bfloat16 from(float x) { return __float2bfloat16_rn(x); }
  __device__ static __nv_bfloat16 from(double x) { return __double2bfloat16(x); }
};
template <>
struct Store<__half> {
  __device__ static __half from(float x) { return __float2half_rn(x); }
  __device__ static __half from(double x) { return __double2half(x); }
};

// torch.lerp's split: exact at both ends, and the smaller of weight and 1 - weight scales the difference.
template <typename T>
__device__ __forceinline__ T lerp(T start, T end, T weight) {
  return fabs(weight) < T(0.5) ? start + weight * (end - start) : end - (end - start) * (T(1) - weight);
}

__device__ __forceinline__ int64_t first_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

}  // namespace muon_cuda
