#pragma once
// Launchers for the kernels in muon_momentum.cu. Raw pointers and a stream only: no torch headers, so the .cu
// compiles in seconds and the torch-facing code stays in muon_momentum_cuda.cpp.
#include <cstdint>

#include <cuda_runtime_api.h>

#include "dtype.h"

namespace muon_cuda {

// flags[0..count) = 1: every gradient counts as finite until its check clears its flag.
void launch_mark_all_finite(float* flags, int64_t count, cudaStream_t stream);

// flags[t] = 0 when any of grads[t][0..numels[t]) is NaN or +-Inf; otherwise flags[t] is left alone. Every gradient
// of grad_dtype; up to 64 of them a launch.
void launch_check_finite(const void* const* grads, const int64_t* numels, int64_t count, DType grad_dtype,
                         float* flags, cudaStream_t stream);

// When *flag != 0: buffer <- lerp(buffer, grad, 1 - beta) and update <- nesterov ? lerp(grad, buffer, beta) : buffer.
// When *flag == 0: buffer is untouched and update <- 0. The flag is read on the device, so no host sync is needed.
// buffer and grad share value_dtype; update may have any supported dtype (the cast is fused into the store).
void launch_momentum_update(void* buffer, const void* grad, DType value_dtype, void* update, DType update_dtype,
                            int64_t numel, double beta, bool nesterov, const float* flag, cudaStream_t stream);

}  // namespace muon_cuda
