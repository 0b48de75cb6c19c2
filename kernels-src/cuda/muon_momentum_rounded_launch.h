#pragma once
// Launchers for the kernels in muon_momentum_rounded.cu (the `muon_momentum_rounded_` op). Raw pointers and a stream
// only: no torch headers, so the .cu compiles in seconds and the torch-facing code stays in
// muon_momentum_rounded_cuda.cpp.
#include <cstdint>

#include <cuda_runtime_api.h>

#include "../common/stochastic_rounding.h"
#include "dtype.h"

namespace muon_cuda {

// Entries per int8 block along the last dim, one float32 scale each: torch_binding.h's kRoundedBlock (the binding
// checks they agree). The int8 kernel runs one thread per entry of a block, so it is also that kernel's block size.
constexpr int64_t kQuantBlock = 256;

// What both stored forms share. grad: grad_dtype, read as float32 (a double is rounded to float); update: any
// update_dtype, written from the float32 value; positions: each entry's position for the random bits (its flat index
// for a whole tensor); count: the tensor's rounding count (one int64); flag: the tensor's finite flag.
// count and flag are read on the device: no host sync.
struct RoundedMomentumArgs {
  const void* grad;
  DType grad_dtype;
  void* update;
  DType update_dtype;
  muon_rounding::EntryPositions positions;
  const int64_t* count;
  const float* flag;
  int64_t numel;
  double beta;
  bool nesterov;
};

// When *flag != 0, per entry j: v = lerp(float(buffer[j]), float(grad[j]), 1 - beta) in float32;
// update[j] <- nesterov ? lerp(grad, v, beta) : v; buffer[j] <- v in bfloat16, rounded at random
// (muon_rounding::bfloat16_bits_rounded with the bits of position j and *count).
// When *flag == 0: buffer is untouched and update <- 0.
void launch_momentum_rounded_bfloat16(void* buffer, const RoundedMomentumArgs& args, cudaStream_t stream);

// The same on int8 codes: the buffer is lines of line_length entries, each cut into blocks of kQuantBlock (the last
// one of a line may be shorter) whose values are code * scales[block] (scales: one per block, in block order). After
// the step each block takes scale = max |v| / 127 and codes muon_rounding::linear_code(v, scale, bits).
// When *flag == 0: codes and scales are untouched and update <- 0.
void launch_momentum_rounded_int8(int8_t* codes, float* scales, int64_t line_length, const RoundedMomentumArgs& args,
                                  cudaStream_t stream);

}  // namespace muon_cuda
