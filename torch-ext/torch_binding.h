#pragma once

#include <ATen/core/Tensor.h>

// One implementation per backend, each defined in kernels-src/<backend>/. They receive arguments that
// torch_binding.cpp has already validated (same device, matching shapes, supported dtypes, contiguous).
using MuonMomentumImpl = void (*)(at::TensorList momentum_buffers, at::TensorList grads, at::TensorList updates,
                                  const at::Tensor& finite, double beta, bool nesterov);

void muon_momentum_cpu(at::TensorList momentum_buffers, at::TensorList grads, at::TensorList updates,
                       const at::Tensor& finite, double beta, bool nesterov);

void muon_momentum_cuda(at::TensorList momentum_buffers, at::TensorList grads, at::TensorList updates,
                        const at::Tensor& finite, double beta, bool nesterov);
