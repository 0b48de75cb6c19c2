// Finite flags on the GPU (`finite_flags_`, and the momentum ops' first pass): all flags set to 1, then a check that
// clears the flag of each tensor holding a NaN or Inf, one launch per run of tensors of one dtype.
#include <cstdint>
#include <vector>

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
  std::vector<const void*> pointers;
  std::vector<int64_t> numels;
  for (size_t first = 0; first < tensors.size();) {
    const auto scalar_type = tensors[first].scalar_type();
    const muon_cuda::DType dtype = muon_cuda::launch_dtype(scalar_type, "finite_flags_: tensors");
    pointers.clear();
    numels.clear();
    size_t end = first;
    for (; end < tensors.size() && tensors[end].scalar_type() == scalar_type; ++end) {
      pointers.push_back(tensors[end].const_data_ptr());
      numels.push_back(tensors[end].numel());
    }
    muon_cuda::launch_check_finite(pointers.data(), numels.data(), static_cast<int64_t>(end - first), dtype,
                                   flags + first, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    first = end;
  }
}
