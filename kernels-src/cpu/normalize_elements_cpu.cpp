// AdaMuon's normalization on the CPU (`normalization="element"`): each entry's second moment moves toward the square
// of its orthogonalized update, the update is divided by the moment's root, and the sum of squares of the result (what
// the RMS rule scales by) is returned, in one pass that reads the update and the moment and writes both. A tall
// matrix's update, computed on its transpose, is read as it is stored, tile by tile. The composition of torch ops it
// replaces made a float32 copy of the 16-bit update, its squares, the denominator and the quotient, each op of mixed
// dtypes converting its inputs through another copy; before transposed updates and the sums came in here, a
// contiguous copy of each tall update (~145 ms) and a float32 norm of each result (~75 ms) cost AdaMuon's
// GPT-2-small bf16 step on a 2-core Xeon more than the op itself (~75 ms).
#include <algorithm>
#include <cmath>
#include <cstring>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "finite_cpu.h"
#include "momentum_math_cpu.h"
#include "transpose_cpu.h"
#include "torch_binding.h"

namespace {

using muon_cpu::kGrainSize;
using muon_cpu::kPrefetchBytes;
using muon_cpu::kTile;
using muon_cpu::store;
using muon_cpu::widen;

// Independent partial sums of the results' squares (one chain would keep the loop scalar), each summing the squares
// of a block's entries in the moment's dtype before the block's total joins the float64 sum: float64 partials in the
// loop itself made GCC vectorize it at their width, 4 floats per 32-byte vector, and the pass took 1.5x the time.
constexpr int kLanes = 16;
constexpr int64_t kBlock = 16 * kLanes;

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

// Steps one entry's moment and divides the entry; returns the square of what was stored. Without a bias correction
// (the RMS rule's case, where the correction is 1) the division by it, exact then, is left out: in cache the pass is
// bound by the CPU's divider, and that division was a third of its work (float32: 0.64 -> 0.53 ns per entry).
template <bool kCorrected, typename update_t, typename moment_t>
C10_ALWAYS_INLINE moment_t normalize_entry(update_t* update, moment_t* moment, const ElementRule<moment_t>& rule) {
  const auto value = static_cast<moment_t>(widen(*update));
  const moment_t second = std::fma(rule.one_minus_beta, value * value, *moment * rule.decay);
  *moment = second;
  const moment_t root = std::sqrt(kCorrected ? second / rule.correction : second);
  const auto stored = static_cast<moment_t>(store(update, value / (root + rule.eps)));
  return stored * stored;
}

// `count` entries laid out alike in update and moment, in place; returns the sum of squares of what was stored. The
// moment streams from memory and is prefetched kPrefetchBytes ahead, and so is the update where kUpdateStreams (not a
// tile's block in cache): a (12, 3072, 768) bf16 update took 8.7 ms this way, 30 with the hardware's prefetchers
// alone, and 40 ms stored transposed, 48 without the moment's prefetches (2-core Xeon).
template <bool kCorrected, bool kUpdateStreams, typename update_t, typename moment_t>
MUON_VECTOR_CLONES double normalize_range(update_t* __restrict__ update, moment_t* __restrict__ moment, int64_t count,
                                          const ElementRule<moment_t> rule) {
  double total = 0;
  for (int64_t begin = 0; begin < count; begin += kBlock) {
    const int64_t size = std::min(kBlock, count - begin), whole = size / kLanes * kLanes;
    moment_t partials[kLanes] = {};
    for (int64_t j = begin; j < begin + whole; j += kLanes) {
      if constexpr (kUpdateStreams) {
        __builtin_prefetch(reinterpret_cast<const char*>(update + j) + kPrefetchBytes, 1);
      }
      __builtin_prefetch(reinterpret_cast<const char*>(moment + j) + kPrefetchBytes, 1);
      for (int k = 0; k < kLanes; ++k) {
        partials[k] += normalize_entry<kCorrected>(update + j + k, moment + j + k, rule);
      }
    }
    for (int64_t j = begin + whole; j < begin + size; ++j) {
      partials[0] += normalize_entry<kCorrected>(update + j, moment + j, rule);
    }
    for (int k = 0; k < kLanes; ++k) total += partials[k];
  }
  return total;
}

// One tile of an update stored transposed: its stored rows are copied into a block, which is transposed into the
// moment's layout, normalized row by row there (by normalize_range, so with the same arithmetic as a contiguous
// update), transposed back and copied out. A partial tile at an edge is padded with zeros, which are moved but
// neither normalized nor stored.
template <bool kCorrected, typename update_t, typename moment_t>
MUON_VECTOR_CLONES double normalize_transposed_tile(update_t* update, moment_t* moment,
                                                    const muon_cpu::TransposedTiles& tiles, int64_t tile,
                                                    const ElementRule<moment_t>& rule) {
  const muon_cpu::TilePlace place(tiles, tile);
  update += place.matrix_offset + place.first_col * tiles.rows + place.first_row;
  moment += place.matrix_offset + place.first_row * tiles.cols + place.first_col;
  alignas(64) update_t stored[kTile][kTile];  // [col][row]: the update's layout
  if (place.partial()) {
    std::memset(static_cast<void*>(stored), 0, sizeof(stored));
  }
  for (int64_t col = 0; col < place.col_count; ++col) {
    std::memcpy(static_cast<void*>(stored[col]), update + col * tiles.rows, place.row_count * sizeof(update_t));
  }
  alignas(64) update_t values[kTile][kTile];  // [row][col]: the moment's
  muon_cpu::transpose_tile(stored, values);
  double total = 0;
  for (int64_t row = 0; row < place.row_count; ++row) {
    total += normalize_range<kCorrected, false>(values[row], moment + row * tiles.cols, place.col_count, rule);
  }
  muon_cpu::transpose_tile(values, stored);
  for (int64_t col = 0; col < place.col_count; ++col) {
    std::memcpy(static_cast<void*>(update + col * tiles.rows), stored[col], place.row_count * sizeof(update_t));
  }
  return total;
}

template <bool kCorrected, typename update_t, typename moment_t>
double normalize_tensor(const at::Tensor& update_tensor, moment_t* moment, const ElementRule<moment_t>& rule) {
  auto* update = update_tensor.mutable_data_ptr<update_t>();
  const auto add = [](double a, double b) { return a + b; };
  if (update_tensor.is_contiguous()) {
    return at::parallel_reduce(0, update_tensor.numel(), kGrainSize, 0.0,
                               [&](int64_t begin, int64_t end, double total) {
                                 return total + normalize_range<kCorrected, true>(update + begin, moment + begin,
                                                                                  end - begin, rule);
                               }, add);
  }
  const muon_cpu::TransposedTiles tiles(update_tensor.size(-2), update_tensor.size(-1));
  const int64_t tile_count = update_tensor.numel() / (tiles.rows * tiles.cols) * tiles.per_matrix();
  return at::parallel_reduce(0, tile_count, kGrainSize / (kTile * kTile), 0.0,
                             [&](int64_t begin, int64_t end, double total) {
                               for (int64_t tile = begin; tile < end; ++tile) {
                                 total += normalize_transposed_tile<kCorrected>(update, moment, tiles, tile, rule);
                               }
                               return total;
                             }, add);
}

}  // namespace

void normalize_elements_cpu(at::TensorList updates, at::TensorList moments, const at::Tensor& decays,
                            const at::Tensor& corrections, double one_minus_beta, double eps,
                            const at::Tensor& squares) {
  const double* decay = decays.const_data_ptr<double>();
  const double* correction = corrections.const_data_ptr<double>();
  double* square_sums = squares.mutable_data_ptr<double>();
  for (size_t i = 0; i < updates.size(); ++i) {
    square_sums[i] = 0.0;
    if (updates[i].numel() == 0) {
      continue;
    }
    AT_DISPATCH_FLOATING_TYPES(moments[i].scalar_type(), "normalize_elements_cpu", [&] {
      using moment_t = scalar_t;
      auto* moment = moments[i].mutable_data_ptr<moment_t>();
      const ElementRule<moment_t> rule{static_cast<moment_t>(decay[i]), static_cast<moment_t>(one_minus_beta),
                                       static_cast<moment_t>(correction[i]), static_cast<moment_t>(eps)};
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, updates[i].scalar_type(), "normalize_elements_cpu",
                                      [&] {
        square_sums[i] = rule.correction == moment_t(1)
                             ? normalize_tensor<false, scalar_t, moment_t>(updates[i], moment, rule)
                             : normalize_tensor<true, scalar_t, moment_t>(updates[i], moment, rule);
      });
    });
  }
}
