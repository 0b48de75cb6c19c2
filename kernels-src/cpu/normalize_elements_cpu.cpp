// AdaMuon's normalization on the CPU (`normalization="element"`): each entry's second moment moves toward the square
// of its orthogonalized update, and the update is divided by the moment's root, in one pass that reads the update and
// the moment and writes both. The composition of torch ops it replaces made a float32 copy of the 16-bit update, its
// squares, the denominator and the quotient, each op of mixed dtypes converting its inputs through another copy.
#include <cmath>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "finite_cpu.h"
#include "momentum_math_cpu.h"
#include "torch_binding.h"

namespace {

using muon_cpu::kGrainSize;
using muon_cpu::store;
using muon_cpu::widen;

// The composition's roundings, one after the other: the square, the decayed moment, the moment plus (1 - beta) times
// the square as one fused multiply-add (torch's vectorized foreach add_), the bias-corrected moment, its root, plus
// eps, the quotient, and the update's own dtype last. Taken by value: through a reference GCC reloads the fields
// after each store (see muon_momentum_rounded_cpu.cpp).
template <typename moment_t>
struct ElementRule {
  moment_t decay;
  moment_t one_minus_beta;
  moment_t correction;
  moment_t eps;
};

template <typename update_t, typename moment_t>
MUON_VECTOR_CLONES void normalize_range(update_t* __restrict__ update, moment_t* __restrict__ moment, int64_t count,
                                        const ElementRule<moment_t> rule) {
  for (int64_t j = 0; j < count; ++j) {
    const auto value = static_cast<moment_t>(widen(update[j]));
    const moment_t square = value * value;
    const moment_t decayed = moment[j] * rule.decay;
    const moment_t second = std::fma(rule.one_minus_beta, square, decayed);
    moment[j] = second;
    const moment_t root = std::sqrt(second / rule.correction);
    const moment_t denominator = root + rule.eps;
    store(update + j, value / denominator);
  }
}

}  // namespace

void normalize_elements_cpu(at::TensorList updates, at::TensorList moments, const at::Tensor& decays,
                            const at::Tensor& corrections, double one_minus_beta, double eps) {
  const double* decay = decays.const_data_ptr<double>();
  const double* correction = corrections.const_data_ptr<double>();
  for (size_t i = 0; i < updates.size(); ++i) {
    AT_DISPATCH_FLOATING_TYPES(moments[i].scalar_type(), "normalize_elements_cpu", [&] {
      using moment_t = scalar_t;
      auto* moment = moments[i].mutable_data_ptr<moment_t>();
      const ElementRule<moment_t> rule{static_cast<moment_t>(decay[i]), static_cast<moment_t>(one_minus_beta),
                                       static_cast<moment_t>(correction[i]), static_cast<moment_t>(eps)};
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, updates[i].scalar_type(), "normalize_elements_cpu",
                                      [&] {
        auto* update = updates[i].mutable_data_ptr<scalar_t>();
        at::parallel_for(0, updates[i].numel(), kGrainSize, [&](int64_t begin, int64_t end) {
          normalize_range(update + begin, moment + begin, end - begin, rule);
        });
      });
    });
  }
}
