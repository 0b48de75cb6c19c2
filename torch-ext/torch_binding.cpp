#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

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

// Shared by every backend: the flags are the tensors' own, one per tensor, written where the tensors are.
void check_finite_flags_args(at::TensorList tensors, const at::Tensor& finite) {
  TORCH_CHECK_VALUE(finite.scalar_type() == at::kFloat && finite.dim() == 1 && finite.is_contiguous() &&
                        finite.numel() == static_cast<int64_t>(tensors.size()),
                    "finite_flags_: finite must be a contiguous float32 tensor of shape (", tensors.size(), "), got ",
                    finite.scalar_type(), " of shape ", finite.sizes());
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK_VALUE(tensors[i].device() == finite.device(), "finite_flags_: tensors[", i, "] is on ",
                      tensors[i].device(), " but finite is on ", finite.device());
    TORCH_CHECK_VALUE(is_supported_dtype(tensors[i].scalar_type()), "finite_flags_: tensors[", i, "] has dtype ",
                      tensors[i].scalar_type(), " (expected float32, float64, bfloat16 or float16)");
    TORCH_CHECK_VALUE(tensors[i].is_contiguous(), "finite_flags_: tensors[", i, "] must be contiguous");
  }
}

template <FiniteFlagsImpl impl>
void checked_finite_flags(at::TensorList tensors, const at::Tensor& finite) {
  check_finite_flags_args(tensors, finite);
  impl(tensors, finite);
}

template <MuonMomentumImpl impl>
void checked_muon_momentum(at::TensorList momentum_buffers, at::TensorList grads, at::TensorList updates,
                           const at::Tensor& finite, double beta, bool nesterov) {
  check_muon_momentum_args(momentum_buffers, grads, updates, finite, beta);
  impl(momentum_buffers, grads, updates, finite, beta, nesterov);
}

// The bytes [begin, end) a tensor's elements can occupy (a superset for gapped strides: a safe answer for overlap).
std::pair<uintptr_t, uintptr_t> memory_span(const at::Tensor& tensor) {
  const auto begin = reinterpret_cast<uintptr_t>(tensor.const_data_ptr());
  if (tensor.numel() == 0) {
    return {begin, begin};
  }
  int64_t last = 0;
  for (int64_t dim = 0; dim < tensor.dim(); ++dim) {
    last += (tensor.size(dim) - 1) * tensor.stride(dim);
  }
  return {begin, begin + static_cast<uintptr_t>((last + 1) * tensor.element_size())};
}

bool share_memory(const at::Tensor& first, const at::Tensor& second) {
  const auto [first_begin, first_end] = memory_span(first);
  const auto [second_begin, second_end] = memory_span(second);
  return first_begin < second_end && second_begin < first_end;
}

// out and C: (m, m), or (B, m, m) for a batched X (B, m, k), on X's device and in X's dtype.
void check_gram_operand(const at::Tensor& operand, const char* name, const at::Tensor& X) {
  TORCH_CHECK_VALUE(operand.device() == X.device(), "symmetric_gram_: ", name, " is on ", operand.device(),
                    " but X is on ", X.device());
  TORCH_CHECK_VALUE(operand.scalar_type() == X.scalar_type(), "symmetric_gram_: ", name, " has dtype ",
                    operand.scalar_type(), " but X has dtype ", X.scalar_type());
  std::vector<int64_t> expected(X.sizes().begin(), X.sizes().end());
  expected.back() = X.size(-2);
  TORCH_CHECK_VALUE(operand.sizes() == c10::IntArrayRef(expected), "symmetric_gram_: ", name, " has shape ",
                    operand.sizes(), " but X of shape ", X.sizes(), " needs ", c10::IntArrayRef(expected));
}

// Shared by every backend. X and C may have any strides; out must be contiguous. Inputs may share memory with each
// other (C is often X itself) but not with out, which is overwritten while they are read.
void check_symmetric_gram_args(const at::Tensor& out, const at::Tensor& X, const std::optional<at::Tensor>& C) {
  TORCH_CHECK_VALUE(X.dim() == 2 || X.dim() == 3, "symmetric_gram_: X must be (m, k) or (B, m, k), got shape ",
                    X.sizes());
  TORCH_CHECK_VALUE(is_supported_dtype(X.scalar_type()), "symmetric_gram_: X has dtype ", X.scalar_type(),
                    " (expected float32, float64, bfloat16 or float16)");
  check_gram_operand(out, "out", X);
  TORCH_CHECK_VALUE(out.is_contiguous(), "symmetric_gram_: out must be contiguous");
  TORCH_CHECK_VALUE(!share_memory(X, out), "symmetric_gram_: X shares memory with out");
  if (C.has_value()) {
    check_gram_operand(*C, "C", X);
    TORCH_CHECK_VALUE(!share_memory(*C, out), "symmetric_gram_: C shares memory with out");
  }
}

template <SymmetricGramImpl impl>
void checked_symmetric_gram(at::Tensor& out, const at::Tensor& X, const std::optional<at::Tensor>& C, double alpha,
                            double beta) {
  check_symmetric_gram_args(out, X, C);
  impl(out, X, C, alpha, beta);
}

}  // namespace

TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  // Momentum buffers, updates and flags are written in place; the grads are only read.
  ops.def(
      "muon_momentum_(Tensor(a!)[] momentum_buffers, Tensor[] grads, Tensor(b!)[] updates, Tensor(c!) finite, "
      "float beta, bool nesterov) -> ()");
  // out = alpha * X X^T + beta * C, written whole and exactly symmetric; C (symmetric) and beta are ignored when
  // C is None, and then out's old contents are never read.
  ops.def("symmetric_gram_(Tensor(a!) out, Tensor X, Tensor? C, float alpha, float beta) -> ()");
  // finite[i] = 1.0 where tensors[i] holds no NaN or Inf, else 0.0: the gradient check of AdamW-routed parameters.
  ops.def("finite_flags_(Tensor[] tensors, Tensor(a!) finite) -> ()");
#if defined(CPU_KERNEL)
  ops.impl("muon_momentum_", c10::DeviceType::CPU, &checked_muon_momentum<&muon_momentum_cpu>);
  ops.impl("symmetric_gram_", c10::DeviceType::CPU, &checked_symmetric_gram<&symmetric_gram_cpu>);
  ops.impl("finite_flags_", c10::DeviceType::CPU, &checked_finite_flags<&finite_flags_cpu>);
#endif
#if defined(CUDA_KERNEL)
  ops.impl("muon_momentum_", c10::DeviceType::CUDA, &checked_muon_momentum<&muon_momentum_cuda>);
  ops.impl("symmetric_gram_", c10::DeviceType::CUDA, &checked_symmetric_gram<&symmetric_gram_cuda>);
  ops.impl("finite_flags_", c10::DeviceType::CUDA, &checked_finite_flags<&finite_flags_cuda>);
#endif
}

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
