// Muon's momentum step on the CPU: for each tensor, one parallel pass that checks the gradient is finite, then
// one parallel pass that updates the momentum buffer and writes the update (in the update's own dtype).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "finite_cpu.h"
#include "momentum_math_cpu.h"

namespace {

using muon_cpu::kGrainSize;
using muon_cpu::Lerp;
using muon_cpu::store;

// Nesterov blends with the buffer as stored (rounded to its dtype), as `grad.lerp(buf, beta)` would after `buf.lerp_`.
template <typename value_t, typename update_t, bool nesterov>
MUON_VECTOR_CLONES void update_range(value_t* __restrict__ buffer, const value_t* __restrict__ grad,
                                     update_t* __restrict__ update, int64_t count,
                                     Lerp<at::opmath_type<value_t>> toward_grad,
                                     Lerp<at::opmath_type<value_t>> toward_buffer) {
  using opmath_t = at::opmath_type<value_t>;
  const auto step = [&](int64_t j) {
    const opmath_t g = static_cast<opmath_t>(grad[j]);
    const opmath_t stored = store(buffer + j, toward_grad(static_cast<opmath_t>(buffer[j]), g));
    store(update + j, static_cast<at::opmath_type<update_t>>(nesterov ? toward_buffer(g, stored) : stored));
  };
  muon_cpu::for_each_prefetched<value_t>(count, step, grad, buffer, update);
}

template <typename value_t, typename update_t, bool nesterov>
void update_momentum(value_t* buffer, const value_t* grad, update_t* update, int64_t numel, double beta) {
  using opmath_t = at::opmath_type<value_t>;
  const Lerp<opmath_t> toward_grad(1.0 - beta);
  const Lerp<opmath_t> toward_buffer(beta);
  at::parallel_for(0, numel, kGrainSize, [&](int64_t begin, int64_t end) {
    update_range<value_t, update_t, nesterov>(buffer + begin, grad + begin, update + begin, end - begin, toward_grad,
                                              toward_buffer);
  });
}

template <typename value_t>
void update_momentum_into(const at::Tensor& buffer, const at::Tensor& grad, const at::Tensor& update, double beta,
                          bool nesterov) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, update.scalar_type(), "muon_momentum_cpu", [&] {
    auto* buffer_data = buffer.mutable_data_ptr<value_t>();
    const auto* grad_data = grad.const_data_ptr<value_t>();
    auto* update_data = update.mutable_data_ptr<scalar_t>();
    if (nesterov) {
      update_momentum<value_t, scalar_t, true>(buffer_data, grad_data, update_data, grad.numel(), beta);
    } else {
      update_momentum<value_t, scalar_t, false>(buffer_data, grad_data, update_data, grad.numel(), beta);
    }
  });
}

}  // namespace

void muon_momentum_cpu(at::TensorList momentum_buffers, at::TensorList grads, at::TensorList updates,
                       const at::Tensor& finite, double beta, bool nesterov) {
  float* flags = finite.mutable_data_ptr<float>();
  for (size_t i = 0; i < grads.size(); ++i) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grads[i].scalar_type(), "muon_momentum_cpu", [&] {
      const bool grad_finite = muon_cpu::all_finite(grads[i].const_data_ptr<scalar_t>(), grads[i].numel());
      flags[i] = grad_finite ? 1.0f : 0.0f;
      if (grad_finite) {
        update_momentum_into<scalar_t>(momentum_buffers[i], grads[i], updates[i], beta, nesterov);
      } else {
        // The buffer keeps its value; a zero update makes Newton-Schulz return zero, leaving the parameter as is.
        updates[i].zero_();
      }
    });
  }
}
