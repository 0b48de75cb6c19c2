// The CUDA side of the op: device guard, stream and dtype mapping around the launchers in muon_momentum.cu.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "muon_momentum_launch.h"

namespace {

muon_cuda::DType launch_dtype(c10::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return muon_cuda::DType::kFloat32;
    case at::kDouble:
      return muon_cuda::DType::kFloat64;
    case at::kBFloat16:
      return muon_cuda::DType::kBFloat16;
    case at::kHalf:
      return muon_cuda::DType::kFloat16;
    default:
      TORCH_CHECK_VALUE(false, "muon_momentum_: unsupported dtype ", dtype);
  }
}

}  // namespace

void muon_momentum_cuda(at::TensorList momentum_buffers, at::TensorList grads, at::TensorList updates,
                        const at::Tensor& finite, double beta, bool nesterov) {
  const c10::cuda::CUDAGuard device_guard(finite.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  float* flags = finite.mutable_data_ptr<float>();
  muon_cuda::launch_mark_all_finite(flags, finite.numel(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  for (size_t i = 0; i < grads.size(); ++i) {
    const muon_cuda::DType value_dtype = launch_dtype(grads[i].scalar_type());
    muon_cuda::launch_check_finite(grads[i].const_data_ptr(), value_dtype, grads[i].numel(), flags + i, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    muon_cuda::launch_momentum_update(momentum_buffers[i].mutable_data_ptr(), grads[i].const_data_ptr(), value_dtype,
                                      updates[i].mutable_data_ptr(), launch_dtype(updates[i].scalar_type()),
                                      grads[i].numel(), beta, nesterov, flags + i, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}
