// Finite flags on the GPU for `muon_momentum_rounded_`'s first pass: all flags set to 1, then one grid-stride check
// per tensor that clears its flag.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "launch_dtype.h"
#include "muon_momentum_launch.h"

void finite_flags_cuda(at::TensorList tensors, const at::Tensor& finite) {
  const c10::cuda::CUDAGuard device_guard(finite.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  float* flags = finite.mutable_data_ptr<float>();
  muon_cuda::launch_mark_all_finite(flags, finite.numel(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const muon_cuda::DType dtype = muon_cuda::launch_dtype(tensors[i].scalar_type(), "finite_flags_: tensors");
    muon_cuda::launch_check_finite(tensors[i].const_data_ptr(), dtype, tensors[i].numel(), flags + i, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}
