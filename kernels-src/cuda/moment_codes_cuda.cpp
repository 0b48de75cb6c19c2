// The CUDA side of `load_moment_` and `store_moment_`: device guard, stream and code mapping around the launchers in
// moment_codes.cu. torch_binding.cpp has validated the arguments.
#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "moment_codes_launch.h"
#include "torch_binding.h"

static_assert(muon_cuda::kMomentBlock == kRoundedBlock, "the int8 kernels' block must be the op's");

namespace {

muon_cuda::Int8Code int8_code(MomentCode code) {
  switch (code) {
    case MomentCode::kLinear:
      return muon_cuda::Int8Code::kLinear;
    case MomentCode::kE4m3:
      return muon_cuda::Int8Code::kE4m3;
    case MomentCode::kE4m3Root:
      return muon_cuda::Int8Code::kE4m3Root;
    case MomentCode::kBFloat16:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "a bfloat16 moment has no int8 codes");
}

}  // namespace

void load_moment_cuda(at::Tensor& out, const at::Tensor& stored, const std::optional<at::Tensor>& scales,
                      MomentCode code) {
  const c10::cuda::CUDAGuard device_guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  float* values = out.mutable_data_ptr<float>();
  if (code == MomentCode::kBFloat16) {
    muon_cuda::launch_load_moment_bfloat16(
        values, reinterpret_cast<const uint16_t*>(stored.const_data_ptr<at::BFloat16>()), stored.numel(), stream);
  } else {  // int8 codes (at least one dim) with a float32 scale per block along the last dim
    muon_cuda::launch_load_moment_int8(values, stored.const_data_ptr<int8_t>(), scales->const_data_ptr<float>(),
                                       stored.numel(), stored.size(-1), int8_code(code), stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void store_moment_cuda(at::Tensor& stored, const std::optional<at::Tensor>& scales, const at::Tensor& values,
                       const at::Tensor& rounding_count, const std::optional<at::Tensor>& row_positions,
                       const std::optional<at::Tensor>& column_positions, int64_t position_offset,
                       const at::Tensor& taken, MomentCode code) {
  const c10::cuda::CUDAGuard device_guard(values.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const muon_cuda::MomentWrite write{
      muon_rounding::entry_positions(row_positions, column_positions, position_offset),
      rounding_count.const_data_ptr<int64_t>(),
      taken.const_data_ptr<float>(),
  };
  const float* source = values.const_data_ptr<float>();
  if (code == MomentCode::kBFloat16) {
    muon_cuda::launch_store_moment_bfloat16(reinterpret_cast<uint16_t*>(stored.mutable_data_ptr<at::BFloat16>()),
                                            source, stored.numel(), write, stream);
  } else {
    muon_cuda::launch_store_moment_int8(stored.mutable_data_ptr<int8_t>(), scales->mutable_data_ptr<float>(), source,
                                        stored.numel(), stored.size(-1), int8_code(code), write, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
