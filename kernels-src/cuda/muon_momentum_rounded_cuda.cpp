// The CUDA side of `muon_momentum_rounded_`: device guard, stream and dtype mapping around the launchers in
// muon_momentum_rounded.cu. torch_binding.cpp has validated the arguments.
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "launch_dtype.h"
#include "muon_momentum_rounded_launch.h"
#include "torch_binding.h"

static_assert(muon_cuda::kQuantBlock == kRoundedBlock, "the int8 kernel's block must be the op's");

void muon_momentum_rounded_cuda(at::TensorList momentum_buffers, const OptionalTensors& scales, at::TensorList grads,
                                at::TensorList updates, const at::Tensor& finite, at::TensorList rounding_counts,
                                const OptionalTensors& row_positions, const OptionalTensors& column_positions,
                                double beta, bool nesterov) {
  const c10::cuda::CUDAGuard device_guard(finite.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  finite_flags_cuda(grads, finite);
  const float* flags = finite.const_data_ptr<float>();
  for (size_t i = 0; i < grads.size(); ++i) {
    const muon_cuda::RoundedMomentumArgs args{
        grads[i].const_data_ptr(),
        muon_cuda::launch_dtype(grads[i].scalar_type(), "muon_momentum_rounded_: grads"),
        updates[i].mutable_data_ptr(),
        muon_cuda::launch_dtype(updates[i].scalar_type(), "muon_momentum_rounded_: updates"),
        muon_rounding::entry_positions(row_positions.get(i), column_positions.get(i), 0),
        rounding_counts[i].const_data_ptr<int64_t>(),
        flags + i,
        grads[i].numel(),
        beta,
        nesterov,
    };
    const at::Tensor& buffer = momentum_buffers[i];
    const std::optional<at::Tensor> scale = scales.get(i);
    if (scale.has_value()) {  // int8 codes (at least one dim) with a float32 scale per block along the last dim
      muon_cuda::launch_momentum_rounded_int8(buffer.mutable_data_ptr<int8_t>(), scale->mutable_data_ptr<float>(),
                                              buffer.size(-1), args, stream);
    } else {  // bfloat16
      muon_cuda::launch_momentum_rounded_bfloat16(buffer.mutable_data_ptr(), args, stream);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}
