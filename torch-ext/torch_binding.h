#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

// One implementation per backend, each defined in kernels-src/<backend>/. They receive arguments that
// torch_binding.cpp has already validated (same device, matching shapes, supported dtypes, contiguous where needed).
using MuonMomentumImpl = void (*)(at::TensorList momentum_buffers, at::TensorList grads, at::TensorList updates,
                                  const at::Tensor& finite, double beta, bool nesterov);

void muon_momentum_cpu(at::TensorList momentum_buffers, at::TensorList grads, at::TensorList updates,
                       const at::Tensor& finite, double beta, bool nesterov);

void muon_momentum_cuda(at::TensorList momentum_buffers, at::TensorList grads, at::TensorList updates,
                        const at::Tensor& finite, double beta, bool nesterov);

// out = alpha * X X^T + beta * C (beta and C ignored when C is absent), out and C symmetric: X (m, k) or (B, m, k).
using SymmetricGramImpl = void (*)(at::Tensor& out, const at::Tensor& X, const std::optional<at::Tensor>& C,
                                   double alpha, double beta);

void symmetric_gram_cpu(at::Tensor& out, const at::Tensor& X, const std::optional<at::Tensor>& C, double alpha,
                        double beta);

void symmetric_gram_cuda(at::Tensor& out, const at::Tensor& X, const std::optional<at::Tensor>& C, double alpha,
                         double beta);

// finite[i] = 1.0 when tensors[i] holds no NaN or +-Inf, else 0.0; the tensors are only read.
using FiniteFlagsImpl = void (*)(at::TensorList tensors, const at::Tensor& finite);

void finite_flags_cpu(at::TensorList tensors, const at::Tensor& finite);

void finite_flags_cuda(at::TensorList tensors, const at::Tensor& finite);
