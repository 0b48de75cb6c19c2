// The `squared_norms_` op on the CPU: each tensor's sum of squares, accumulated in float64, in one parallel pass at
// memory speed. In float64 the squares of float32, bfloat16 and float16 values can neither overflow nor vanish, so a
// sum is finite exactly when its tensor is: gradient clipping gets its norm and the step's finite check in one read.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "finite_cpu.h"
#include "momentum_math_cpu.h"

namespace {

// Sixteen independent partial sums: one chain of additions would make every load wait on the previous add.
template <typename value_t>
MUON_VECTOR_CLONES double block_sum_of_squares(const value_t* __restrict__ values, int64_t count) {
  constexpr int lanes = 16;
  double partials[lanes] = {};
  const int64_t whole = count / lanes * lanes;
  for (int64_t j = 0; j < whole; j += lanes) {
    for (int k = 0; k < lanes; ++k) {
      const double value = muon_cpu::widen(values[j + k]);
      partials[k] += value * value;
    }
  }
  double total = std::accumulate(partials, partials + lanes, 0.0);
  for (int64_t j = whole; j < count; ++j) {
    const double value = muon_cpu::widen(values[j]);
    total += value * value;
  }
  return total;
}

// Blocks of a fixed size, added in block order: the sum does not depend on how many threads shared the work.
template <typename value_t>
double sum_of_squares(const value_t* values, int64_t numel) {
  const int64_t blocks = (numel + muon_cpu::kGrainSize - 1) / muon_cpu::kGrainSize;
  std::vector<double> partials(blocks);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t first = block * muon_cpu::kGrainSize;
      partials[block] = block_sum_of_squares(values + first, std::min(muon_cpu::kGrainSize, numel - first));
    }
  });
  return std::accumulate(partials.begin(), partials.end(), 0.0);
}

}  // namespace

void squared_norms_cpu(at::TensorList tensors, const at::Tensor& sums) {
  double* out = sums.mutable_data_ptr<double>();
  for (size_t i = 0; i < tensors.size(); ++i) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tensors[i].scalar_type(), "squared_norms_cpu", [&] {
      out[i] = sum_of_squares(tensors[i].const_data_ptr<scalar_t>(), tensors[i].numel());
    });
  }
}
