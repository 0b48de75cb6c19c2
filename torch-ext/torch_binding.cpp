#include <cmath>

#include <torch/library.h>

#include "registration.h"
#include "torch_binding.h"

namespace {

bool is_supported_dtype(c10::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf;
}

void check_tensor(const at::Tensor& tensor, const char* name, size_t index, const at::Tensor& finite) {
  TORCH_CHECK_VALUE(tensor.device() == finite.device(), "muon_momentum_: ", name, "[", index, "] is on ",
                    tensor.device(), " but finite is on ", finite.device());
  TORCH_CHECK_VALUE(is_supported_dtype(tensor.scalar_type()), "muon_momentum_: ", name, "[", index,
                    "] has dtype ", tensor.scalar_type(), " (expected float32, float64, bfloat16 or float16)");
  TORCH_CHECK_VALUE(tensor.is_contiguous(), "muon_momentum_: ", name, "[", index, "] must be contiguous");
}

// Shared by every backend, so the rules cannot drift between CPU and CUDA.
void check_muon_momentum_args(at::TensorList momentum_buffers, at::TensorList grads, at::TensorList updates,
                              const at::Tensor& finite, double beta) {
  const size_t count = momentum_buffers.size();
  TORCH_CHECK_VALUE(grads.size() == count, "muon_momentum_: grads has ", grads.size(),
                    " tensors but momentum_buffers has ", count);
  TORCH_CHECK_VALUE(updates.size() == count, "muon_momentum_: updates has ", updates.size(),
                    " tensors but momentum_buffers has ", count);
  TORCH_CHECK_VALUE(finite.scalar_type() == at::kFloat && finite.dim() == 1 && finite.is_contiguous() &&
                        finite.numel() == static_cast<int64_t>(count),
                    "muon_momentum_: finite must be a contiguous float32 tensor of shape (", count, "), got ",
                    finite.scalar_type(), " of shape ", finite.sizes());
  TORCH_CHECK_VALUE(std::isfinite(beta) && beta >= 0.0 && beta <= 1.0, "muon_momentum_: beta must be in [0, 1], got ",
                    beta);
  for (size_t i = 0; i < count; ++i) {
    check_tensor(momentum_buffers[i], "momentum_buffers", i, finite);
    check_tensor(grads[i], "grads", i, finite);
    check_tensor(updates[i], "updates", i, finite);
    TORCH_CHECK_VALUE(grads[i].sizes() == momentum_buffers[i].sizes(), "muon_momentum_: grads[", i, "] has shape ",
                      grads[i].sizes(), " but momentum_buffers[", i, "] has shape ", momentum_buffers[i].sizes());
    TORCH_CHECK_VALUE(grads[i].scalar_type() == momentum_buffers[i].scalar_type(), "muon_momentum_: grads[", i,
                      "] has dtype ", grads[i].scalar_type(), " but momentum_buffers[", i, "] has dtype ",
                      momentum_buffers[i].scalar_type());
    TORCH_CHECK_VALUE(updates[i].sizes() == momentum_buffers[i].sizes(), "muon_momentum_: updates[", i,
                      "] has shape ", updates[i].sizes(), " but momentum_buffers[", i, "] has shape ",
                      momentum_buffers[i].sizes());
  }
}

template <MuonMomentumImpl impl>
void checked_muon_momentum(at::TensorList momentum_buffers, at::TensorList grads, at::TensorList updates,
                           const at::Tensor& finite, double beta, bool nesterov) {
  check_muon_momentum_args(momentum_buffers, grads, updates, finite, beta);
  impl(momentum_buffers, grads, updates, finite, beta, nesterov);
}

}  // namespace

TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  // Momentum buffers, updates and flags are written in place; the grads are only read.
  ops.def(
      "muon_momentum_(Tensor(a!)[] momentum_buffers, Tensor[] grads, Tensor(b!)[] updates, Tensor(c!) finite, "
      "float beta, bool nesterov) -> ()");
#if defined(CPU_KERNEL)
  ops.impl("muon_momentum_", c10::DeviceType::CPU, &checked_muon_momentum<&muon_momentum_cpu>);
#endif
#if defined(CUDA_KERNEL)
  ops.impl("muon_momentum_", c10::DeviceType::CUDA, &checked_muon_momentum<&muon_momentum_cuda>);
#endif
}

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
