// NorMuon's normalization on the CPU (`normalization="neuron"`): each output neuron's (row's) second moment moves
// toward the mean square of its orthogonalized update, the row is divided by the moment's root, and the sum of squares
// of the result (what the RMS rule scales by) is returned. Each parallel task owns whole rows, from their sums to
// their division. A tall matrix's update, computed on its transpose, is read as it is stored: its rows are the stored
// matrix's columns, summed and divided by vectors across them. The composition of torch ops it replaces (a
// contiguous copy of each transposed update, then a float32 copy in the row norms, in the division and in the RMS
// norm, and a copy back to 16 bits) took ~300 ms of NorMuon's GPT-2-small step (2-core Xeon).
#include <algorithm>
#include <cmath>
#include <vector>

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

// Rows of a transposed matrix per task at the least: each stored row is then read in runs of this many entries,
// long enough for the hardware's stream prefetchers (shorter runs read memory at half speed, 2-core Xeon).
constexpr int64_t kTransposedRunRows = 256;
// Independent partial sums of a row's squares: one chain would keep the loop scalar.
constexpr int kLanes = 16;

// The composition's roundings for one row: the mean square (its sum over cols), the decayed moment plus
// (1 - beta) times the mean as one fused multiply-add (torch's vectorized foreach add_), the bias-corrected moment,
// its root, plus eps. Taken by value (see muon_momentum_rounded_cpu.cpp).
template <typename moment_t>
struct RowRule {
  moment_t decay;
  moment_t one_minus_beta;
  moment_t correction;
  moment_t eps;
  moment_t cols;

  // Steps one row's second moment from its sum of squares; returns what the row is divided by.
  moment_t divisor(moment_t* moment, moment_t sum_of_squares) const {
    const moment_t second = std::fma(one_minus_beta, sum_of_squares / cols, *moment * decay);
    *moment = second;
    return std::sqrt(second / correction) + eps;
  }
};

// The first read of a row: the rows of a contiguous update follow each other, and are prefetched as one stream
// (a (12, 3072, 768) bf16 update: 9.8-10.2 ms against 12.1 with the hardware's prefetchers alone, 2-core Xeon); the
// division's second read finds the row in cache.
template <typename update_t, typename moment_t>
MUON_VECTOR_CLONES moment_t row_sum_of_squares(const update_t* __restrict__ row, int64_t count) {
  moment_t partials[kLanes] = {};
  const int64_t whole = count / kLanes * kLanes;
  for (int64_t j = 0; j < whole; j += kLanes) {
    __builtin_prefetch(reinterpret_cast<const char*>(row + j) + muon_cpu::kPrefetchBytes, 1);
    for (int k = 0; k < kLanes; ++k) {
      const auto value = static_cast<moment_t>(widen(row[j + k]));
      partials[k] += value * value;
    }
  }
  moment_t total = 0;
  for (int k = 0; k < kLanes; ++k) total += partials[k];
  for (int64_t j = whole; j < count; ++j) {
    const auto value = static_cast<moment_t>(widen(row[j]));
    total += value * value;
  }
  return total;
}

// One row divided in place; returns the sum of squares of what was stored.
template <typename update_t, typename moment_t>
MUON_VECTOR_CLONES double divide_row(update_t* __restrict__ row, int64_t count, moment_t divisor) {
  double partials[kLanes] = {};
  const int64_t whole = count / kLanes * kLanes;
  for (int64_t j = 0; j < whole; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const double stored = store(row + j + k, static_cast<moment_t>(widen(row[j + k])) / divisor);
      partials[k] += stored * stored;
    }
  }
  double total = 0;
  for (int k = 0; k < kLanes; ++k) total += partials[k];
  for (int64_t j = whole; j < count; ++j) {
    const double stored = store(row + j, static_cast<moment_t>(widen(row[j])) / divisor);
    total += stored * stored;
  }
  return total;
}

// A stored row of a transposed matrix adds one square to each of `count` rows' sums.
template <typename update_t, typename moment_t>
MUON_VECTOR_CLONES void add_squares(const update_t* __restrict__ stored_row, moment_t* __restrict__ sums,
                                    int64_t count) {
  for (int64_t j = 0; j < count; ++j) {
    const auto value = static_cast<moment_t>(widen(stored_row[j]));
    sums[j] += value * value;
  }
}

// A stored row of a transposed matrix, each entry divided by its row's divisor; returns the sum of squares of what
// was stored. One partial sum per entry, so the loop vectorizes.
template <typename update_t, typename moment_t>
MUON_VECTOR_CLONES void divide_across(update_t* __restrict__ stored_row, const moment_t* __restrict__ divisors,
                                      double* __restrict__ squares, int64_t count) {
  for (int64_t j = 0; j < count; ++j) {
    const double stored = store(stored_row + j, static_cast<moment_t>(widen(stored_row[j])) / divisors[j]);
    squares[j] += stored * stored;
  }
}

struct Matrices {
  int64_t batch;
  int64_t rows;
  int64_t cols;
};

// Rows [begin, end) of a stack stored row-major.
template <typename update_t, typename moment_t>
double normalize_straight(update_t* update, moment_t* moment, const Matrices& shape, int64_t begin, int64_t end,
                          const RowRule<moment_t>& rule) {
  double total = 0;
  for (int64_t row = begin; row < end; ++row) {
    update_t* values = update + row * shape.cols;
    total += divide_row(values, shape.cols, rule.divisor(moment + row, row_sum_of_squares<update_t, moment_t>(
                                                                            values, shape.cols)));
  }
  return total;
}

// Rows [first, first + count) of one matrix stored transposed (cols x rows) at `stored`.
template <typename update_t, typename moment_t>
double normalize_transposed(update_t* stored, moment_t* moment, const Matrices& shape, int64_t first, int64_t count,
                            const RowRule<moment_t>& rule) {
  std::vector<moment_t> values(count, moment_t(0));  // the rows' sums, then their divisors
  for (int64_t col = 0; col < shape.cols; ++col) {
    add_squares(stored + col * shape.rows + first, values.data(), count);
  }
  for (int64_t row = 0; row < count; ++row) {
    values[row] = rule.divisor(moment + first + row, values[row]);
  }
  std::vector<double> squares(count, 0.0);
  for (int64_t col = 0; col < shape.cols; ++col) {
    divide_across(stored + col * shape.rows + first, values.data(), squares.data(), count);
  }
  double total = 0;
  for (const double square : squares) total += square;
  return total;
}

template <typename update_t, typename moment_t>
double normalize_tensor(const at::Tensor& update_tensor, moment_t* moment, const RowRule<moment_t>& rule) {
  auto* update = update_tensor.mutable_data_ptr<update_t>();
  const Matrices shape{update_tensor.numel() / (update_tensor.size(-2) * update_tensor.size(-1)),
                       update_tensor.size(-2), update_tensor.size(-1)};
  const int64_t all_rows = shape.batch * shape.rows;
  const auto reduce = [](double a, double b) { return a + b; };
  if (update_tensor.is_contiguous()) {
    return at::parallel_reduce(0, all_rows, std::max<int64_t>(1, kGrainSize / shape.cols), 0.0,
                               [&](int64_t begin, int64_t end, double total) {
                                 return total + normalize_straight(update, moment, shape, begin, end, rule);
                               }, reduce);
  }
  const int64_t grain = std::max<int64_t>(kTransposedRunRows, kGrainSize / shape.cols);
  return at::parallel_reduce(0, all_rows, grain, 0.0, [&](int64_t begin, int64_t end, double total) {
    for (int64_t matrix = begin / shape.rows; matrix * shape.rows < end; ++matrix) {
      const int64_t first = std::max(begin - matrix * shape.rows, int64_t(0));
      const int64_t last = std::min(end - matrix * shape.rows, shape.rows);
      const int64_t offset = matrix * shape.rows * shape.cols;
      total += normalize_transposed(update + offset, moment + matrix * shape.rows, shape, first, last - first, rule);
    }
    return total;
  }, reduce);
}

}  // namespace

void normalize_rows_cpu(at::TensorList updates, at::TensorList moments, const at::Tensor& decays,
                        const at::Tensor& corrections, double one_minus_beta, double eps, const at::Tensor& squares) {
  const double* decay = decays.const_data_ptr<double>();
  const double* correction = corrections.const_data_ptr<double>();
  double* square_sums = squares.mutable_data_ptr<double>();
  for (size_t i = 0; i < updates.size(); ++i) {
    square_sums[i] = 0.0;
    if (updates[i].numel() == 0) {
      continue;
    }
    AT_DISPATCH_FLOATING_TYPES(moments[i].scalar_type(), "normalize_rows_cpu", [&] {
      using moment_t = scalar_t;
      const RowRule<moment_t> rule{static_cast<moment_t>(decay[i]), static_cast<moment_t>(one_minus_beta),
                                   static_cast<moment_t>(correction[i]), static_cast<moment_t>(eps),
                                   static_cast<moment_t>(updates[i].size(-1))};
      auto* moment = moments[i].mutable_data_ptr<moment_t>();
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, updates[i].scalar_type(), "normalize_rows_cpu", [&] {
        square_sums[i] = normalize_tensor<scalar_t, moment_t>(updates[i], moment, rule);
      });
    });
  }
}
