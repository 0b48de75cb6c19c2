// The `finite_flags_` op on the CPU: one flag per tensor, each tensor read once.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include "finite_cpu.h"

void finite_flags_cpu(at::TensorList tensors, const at::Tensor& finite) {
  float* flags = finite.mutable_data_ptr<float>();
  for (size_t i = 0; i < tensors.size(); ++i) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tensors[i].scalar_type(), "finite_flags_cpu", [&] {
      flags[i] = muon_cpu::all_finite(tensors[i].const_data_ptr<scalar_t>(), tensors[i].numel()) ? 1.0f : 0.0f;
    });
  }
}
