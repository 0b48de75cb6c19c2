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

constexpr int kQuantThreads = static_cast<int>(kQuantBlock);  // one thread per entry of an int8 block

// A skipped step (a non-finite gradient): the update is zero, the stored momentum untouched.
template <typename U>
__device__ void zero_update(U* __restrict__ update, int64_t numel) {
  for (int64_t j = first_index(); j < numel; j += grid_stride()) {
    update[j] = Store<U>::from(0.0f);
  }
}

template <typename G, typename U>
__global__ void rounded_bfloat16_kernel(__nv_bfloat16* __restrict__ buffer, const G* __restrict__ grad,
                                        U* __restrict__ update, Positions position, const int64_t* __restrict__ count,
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

// One CTA of kQuantThreads threads per int8 block (grid-stride over the blocks): thread t takes column t of it.
template <typename G, typename U>
__global__ void __launch_bounds__(kQuantThreads)
    rounded_int8_kernel(int8_t* __restrict__ codes, float* __restrict__ scales, const G* __restrict__ grad,
                        U* __restrict__ update, Positions position, const int64_t* __restrict__ count,
                        const float* __restrict__ flag, int64_t numel, int64_t line_length, int64_t blocks_per_line,
                        int64_t block_count, float grad_weight, float buffer_weight, bool nesterov) {
  if (*flag == 0.0f) {  // the same for the whole grid: no thread is left waiting at a barrier
    zero_update(update, numel);
    return;
  }
  __shared__ float partial[kQuantThreads / kWarp];
  const int64_t rounding_count = *count;
  for (int64_t block = blockIdx.x; block < block_count; block += gridDim.x) {
    const int64_t line = block / blocks_per_line;
    const int64_t column = (block - line * blocks_per_line) * kQuantBlock + threadIdx.x;
    const bool inside = column < line_length;  // the last block of a line may be partial
    const int64_t j = line * line_length + column;
    float v = 0.0f;  // past the line's end: the zero padding of torch's blocks, which leaves the max alone
    uint32_t bits = 0;
    if (inside) {
      bits = muon_rounding::random_bits(position(j), rounding_count);
      // One rounded multiply, never fused into the lerp: the stored value as torch's working copy holds it.
      const float stored = __fmul_rn(static_cast<float>(codes[j]), scales[block]);
      const float g = static_cast<float>(load(grad[j]));
      v = lerp(stored, g, grad_weight);
      update[j] = Store<U>::from(nesterov ? lerp(g, v, buffer_weight) : v);
    }
    // Every thread reaches the barriers inside, those past the line's end too; all reads of scales[block] are
    // before them and its write after.
    const float scale = block_max<kQuantThreads>(fabsf(v), partial) / muon_rounding::kLinearMax;
    if (inside) {
      codes[j] = muon_rounding::linear_code(v, scale, bits);
    }
    if (threadIdx.x == 0) {
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
  const Positions position{args.positions, 0};
  dispatch_args(args, [&](auto grad, auto update) {
    rounded_bfloat16_kernel<<<blocks_for(args.numel), kThreads, 0, stream>>>(
        static_cast<__nv_bfloat16*>(buffer), grad, update, position, args.count, args.flag, args.numel,
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
  const auto grid = static_cast<unsigned int>(std::min(block_count, kMaxBlocks));
  const Positions position{args.positions, 0};
  dispatch_args(args, [&](auto grad, auto update) {
    rounded_int8_kernel<<<grid, kQuantThreads, 0, stream>>>(codes, scales, grad, update, position, args.count,
                                                             args.flag, args.numel, line_length, blocks_per_line,
                                                             block_count, grad_weight_of(args.beta),
                                                             static_cast<float>(args.beta), args.nesterov);
  });
}

}  // namespace muon_cuda
