// The CUDA side of the op: device guard, stream and dtype mapping around the launchers in muon_momentum.cu.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "launch_dtype.h"
#include "muon_momentum_launch.h"
#include "torch_binding.h"

void muon_momentum_cuda(at::TensorList momentum_buffers, at::TensorList grads, at::TensorList updates,
                        const at::Tensor& finite, double beta, bool nesterov) {
  const c10::cuda::CUDAGuard device_guard(finite.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  finite_flags_cuda(grads, finite);
  const float* flags = finite.const_data_ptr<float>();
  for (size_t i = 0; i < grads.size(); ++i) {
    const muon_cuda::DType value_dtype = muon_cuda::launch_dtype(grads[i].scalar_type(), "muon_momentum_: grads");
    const muon_cuda::DType update_dtype =
        muon_cuda::launch_dtype(updates[i].scalar_type(), "muon_momentum_: updates");
    muon_cuda::launch_momentum_update(momentum_buffers[i].mutable_data_ptr(), grads[i].const_data_ptr(), value_dtype,
                                      updates[i].mutable_data_ptr(), update_dtype, grads[i].numel(), beta, nesterov,
                                      flags + i, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}
