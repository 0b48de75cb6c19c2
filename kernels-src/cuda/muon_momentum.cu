// Muon's momentum step on the GPU: a finite check of every gradient that clears each non-finite one's flag (one
// launch for up to kCheckBatch gradients of a dtype), then per tensor a grid-stride update that reads its flag on the
// device.
#include <algorithm>
#include <cstdint>

#include "elementwise.cuh"
#include "op_math.cuh"

#include "muon_momentum_launch.h"

namespace muon_cuda {
namespace {

__global__ void mark_all_finite_kernel(float* flags, int64_t count) {
  for (int64_t i = first_index(); i < count; i += grid_stride()) {
    flags[i] = 1.0f;
  }
}

// Gradients one launch checks, passed by value (about 1.3 KB of the kernel's 4 KB of parameters): tensor t takes the
// blocks [first_block[t], first_block[t + 1]), as many as a launch of its own would (a launch per tensor cost GPT-2
// small's 48 matrices ~340 us of an H100 step for ~110 us of reading).
constexpr int kCheckBatch = 64;
struct CheckBatch {
  const void* grads[kCheckBatch];
  int64_t numels[kCheckBatch];
  unsigned int first_block[kCheckBatch + 1];
};

// The batch of the `count` gradients from `grads`, each given the blocks of a launch of its own (none when empty).
CheckBatch check_batch(const void* const* grads, const int64_t* numels, int count) {
  CheckBatch batch{};
  for (int t = 0; t < count; ++t) {
    batch.grads[t] = grads[t];
    batch.numels[t] = numels[t];
    batch.first_block[t + 1] = batch.first_block[t] + (numels[t] == 0 ? 0 : blocks_for(numels[t]));
  }
  return batch;
}

// The tensor block `block` of a check launch reads: a few dozen comparisons, which pass over tensors with no block.
__host__ __device__ inline int check_tensor(const CheckBatch& batch, int count, unsigned int block) {
  int tensor = 0;
  while (tensor + 1 < count && batch.first_block[tensor + 1] <= block) {
    ++tensor;
  }
  return tensor;
}

template <typename T>
__global__ void check_finite_kernel(CheckBatch batch, int count, float* __restrict__ flags) {
  const int tensor = check_tensor(batch, count, blockIdx.x);
  const T* grad = static_cast<const T*>(batch.grads[tensor]);
  const int64_t numel = batch.numels[tensor];
  const int64_t stride = static_cast<int64_t>(batch.first_block[tensor + 1] - batch.first_block[tensor]) * blockDim.x;
  bool nonfinite = false;
  for (int64_t j = static_cast<int64_t>(blockIdx.x - batch.first_block[tensor]) * blockDim.x + threadIdx.x; j < numel;
       j += stride) {
    nonfinite |= !isfinite(load(grad[j]));
  }
  // At most one store per warp; every writer stores the same 0, so the race between warps is harmless.
  if (__any_sync(0xffffffffu, nonfinite) && threadIdx.x % warpSize == 0) {
    flags[tensor] = 0.0f;
  }
}

template <typename V, typename U, bool nesterov>
__global__ void momentum_update_kernel(V* __restrict__ buffer, const V* __restrict__ grad, U* __restrict__ update,
                                       int64_t numel, OpMath<V> grad_weight,
                                       OpMath<V> buffer_weight, const float* __restrict__ flag) {
  using opmath_t = OpMath<V>;
  if (*flag == 0.0f) {
    for (int64_t j = first_index(); j < numel; j += grid_stride()) {
      update[j] = Store<U>::from(opmath_t(0));
    }
    return;
  }
  for (int64_t j = first_index(); j < numel; j += grid_stride()) {
    const opmath_t g = load(grad[j]);
    const V new_buffer = Store<V>::from(lerp(load(buffer[j]), g, grad_weight));
    buffer[j] = new_buffer;
    // Nesterov blends with the buffer as stored, as `grad.lerp(buf, beta)` would after `buf.lerp_(grad, 1 - beta)`.
    update[j] = Store<U>::from(nesterov ? lerp(g, load(new_buffer), buffer_weight) : load(new_buffer));
  }
}

}  // namespace

void launch_mark_all_finite(float* flags, int64_t count, cudaStream_t stream) {
  if (count == 0) {
    return;
  }
  mark_all_finite_kernel<<<blocks_for(count), kThreads, 0, stream>>>(flags, count);
}

void launch_check_finite(const void* const* grads, const int64_t* numels, int64_t count, DType grad_dtype,
                         float* flags, cudaStream_t stream) {
  for (int64_t first = 0; first < count; first += kCheckBatch) {
    const int size = static_cast<int>(std::min<int64_t>(kCheckBatch, count - first));
    const CheckBatch batch = check_batch(grads + first, numels + first, size);
    if (batch.first_block[size] == 0) {
      continue;
    }
    dispatch_dtype(grad_dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      check_finite_kernel<T><<<batch.first_block[size], kThreads, 0, stream>>>(batch, size, flags + first);
    });
  }
}

void launch_momentum_update(void* buffer, const void* grad, DType value_dtype, void* update, DType update_dtype,
                            int64_t numel, double beta, bool nesterov, const float* flag, cudaStream_t stream) {
  if (numel == 0) {
    return;
  }
  dispatch_dtype(value_dtype, [&](auto value_tag) {
    dispatch_dtype(update_dtype, [&](auto update_tag) {
      using V = typename decltype(value_tag)::type;
      using U = typename decltype(update_tag)::type;
      using opmath_t = OpMath<V>;
      // 1 - beta is taken in double and then rounded, as torch does with a Python-float lerp weight.
      const auto grad_weight = static_cast<opmath_t>(1.0 - beta);
      const auto buffer_weight = static_cast<opmath_t>(beta);
      auto* kernel = nesterov ? momentum_update_kernel<V, U, true> : momentum_update_kernel<V, U, false>;
      kernel<<<blocks_for(numel), kThreads, 0, stream>>>(static_cast<V*>(buffer), static_cast<const V*>(grad),
                                                         static_cast<U*>(update), numel, grad_weight, buffer_weight,
                                                         flag);
    });
  });
}

}  // namespace muon_cuda
