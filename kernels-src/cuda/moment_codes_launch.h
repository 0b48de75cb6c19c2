#pragma once
// Launchers for the kernels in moment_codes.cu (the `load_moment_` and `store_moment_` ops). Raw pointers and a stream
// only: no torch headers, so the .cu compiles in seconds and the torch-facing code stays in moment_codes_cuda.cpp.
#include <cstdint>

#include <cuda_runtime_api.h>

#include "../common/stochastic_rounding.h"

namespace muon_cuda {

// Entries per int8 block along the last dim, one float32 scale each: torch_binding.h's kRoundedBlock (the binding
// checks they agree). The storing kernel runs one thread per entry of a block, so it is also its CTA size.
constexpr int64_t kMomentBlock = 256;

// The int8 codes' meaning (torch_binding.h's MomentCode less kBFloat16, which has launchers of its own): linear
// codes -127..127, float8 e4m3 codes, or e4m3 codes of the square root.
enum class Int8Code { kLinear, kE4m3, kE4m3Root };

// A write's random bits and whether it happens, all on the device (read there: no host sync). The bits of entry j
// are muon_rounding::random_bits(positions(j), *rounding_count); nothing is written where *taken == 0.
struct MomentWrite {
  muon_rounding::EntryPositions positions;
  const int64_t* rounding_count;  // one int64
  const float* taken;             // one float32
};

// out[j] <- the float32 value of bfloat16 bits stored[j], for numel entries.
void launch_load_moment_bfloat16(float* out, const uint16_t* stored, int64_t numel, cudaStream_t stream);

// out[j] <- the value of code j times its block's scale (squared for kE4m3Root): lines of line_length entries, each
// cut into blocks of kMomentBlock (the last one of a line may be shorter), scales one per block in block order.
void launch_load_moment_int8(float* out, const int8_t* codes, const float* scales, int64_t numel, int64_t line_length,
                             Int8Code code, cudaStream_t stream);

// stored[j] <- values[j] in bfloat16, rounded at random (muon_rounding::bfloat16_bits_rounded).
void launch_store_moment_bfloat16(uint16_t* stored, const float* values, int64_t numel, const MomentWrite& write,
                                  cudaStream_t stream);

// Each block of codes (geometry as for the load) <- its values (their square roots for kE4m3Root) under a new scale,
// the block's largest magnitude / the largest code (127 or 448): muon_rounding::linear_code or e4m3_code.
void launch_store_moment_int8(int8_t* codes, float* scales, const float* values, int64_t numel, int64_t line_length,
                              Int8Code code, const MomentWrite& write, cudaStream_t stream);

}  // namespace muon_cuda
