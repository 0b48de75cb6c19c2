// The CUDA side of symmetric_gram_: device guard, stream, dtype and layout mapping around the launcher in
// symmetric_gram.cu. torch_binding.cpp has already checked what every backend shares (shapes, devices, dtypes, out
// contiguous and apart from X and C); what is left here is what the CUDA kernels add.
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "launch_dtype.h"
#include "symmetric_gram_launch.h"

namespace {

// The kernels read each row as a run of adjacent elements (16-byte copies on the tensor-core path); batch and row
// strides are free. A view whose rows are not runs, such as a transpose, is copied once into that layout.
at::Tensor with_unit_row_stride(const at::Tensor& tensor) {
  return tensor.size(-1) <= 1 || tensor.stride(-1) == 1 ? tensor : tensor.contiguous();
}

muon_cuda::MatrixLayout layout_of(const at::Tensor& tensor) {
  return {tensor.dim() == 3 ? tensor.stride(0) : 0, tensor.stride(-2)};
}

struct Capability {
  int major;
  int minor;
};

Capability capability_of(c10::DeviceIndex device) {
  Capability capability{};
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&capability.major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&capability.minor, cudaDevAttrComputeCapabilityMinor, device));
  return capability;
}

}  // namespace

void symmetric_gram_cuda(at::Tensor& out, const at::Tensor& X, const std::optional<at::Tensor>& C, double alpha,
                         double beta) {
  const muon_cuda::DType dtype = muon_cuda::launch_dtype(X.scalar_type(), "symmetric_gram_: X");
  const c10::cuda::CUDAGuard device_guard(X.device());
  const Capability capability = capability_of(X.device().index());
  // bf16 tensor-core products (WMMA bf16 fragments) exist from compute capability 8.0 on.
  TORCH_CHECK(dtype != muon_cuda::DType::kBFloat16 || capability.major >= 8,
              "symmetric_gram_: bfloat16 needs compute capability 8.0 or newer (bf16 tensor cores); this GPU has ",
              capability.major, ".", capability.minor, ". Use float16 or float32 there.");
  const at::Tensor x = with_unit_row_stride(X);
  const std::optional<at::Tensor> c = C.has_value() ? std::optional(with_unit_row_stride(*C)) : std::nullopt;
  const int64_t batch = x.dim() == 3 ? x.size(0) : 1;
  muon_cuda::launch_symmetric_gram(out.mutable_data_ptr(), layout_of(out), x.const_data_ptr(), layout_of(x),
                                   c.has_value() ? c->const_data_ptr() : nullptr,
                                   c.has_value() ? layout_of(*c) : muon_cuda::MatrixLayout{0, 0}, dtype, batch,
                                   x.size(-2), x.size(-1), alpha, beta, capability.major,
                                   c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
