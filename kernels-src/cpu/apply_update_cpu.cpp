// The last write of a Muon step on the CPU: each parameter decayed and moved by its scaled update in one parallel
// pass, the update's dtype converted on the fly, and a transposed update read tile by tile. torch's CPU add_ first
// copies an update of another dtype to the parameter's (a bfloat16 update to a float32 parameter: a fresh float32
// copy, faulted in, for each matrix).
#include <cmath>
#include <cstring>
#include <type_traits>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>

#include "finite_cpu.h"
#include "momentum_math_cpu.h"
#include "transpose_cpu.h"

namespace {

using muon_cpu::kGrainSize;
using muon_cpu::store;
using muon_cpu::kTile;

// The type torch's add_ computes param + step * update in: the opmath type of the two dtypes' common one, so a float64
// update of a float32 parameter (ns_dtype=torch.float64) is added in double, its step size too, and rounded once.
template <typename param_t, typename update_t>
using add_math_t = std::conditional_t<std::is_same_v<param_t, double> || std::is_same_v<update_t, double>, double,
                                      at::opmath_type<param_t>>;

// param <- param * decay, rounded to its dtype, then <- param + step * update, rounded again: what `mul_` then
// `add_(update, alpha=step)` compute, the second with one fused multiply-add as torch's vectorized add does. Written
// as std::fma, not left to contraction, which could as well fuse the decay's product and skip its rounding; the
// x86-64-v3 and v4 clones vectorize it, the baseline clone calls libm's (CPUs without FMA units, from before 2013).
// kStreamed: both stream from memory (not a tile of the update in cache), and are prefetched ahead of their reads.
template <bool kStreamed, typename param_t, typename update_t>
MUON_VECTOR_CLONES void apply_range(param_t* __restrict__ param, const update_t* __restrict__ update, int64_t count,
                                    at::opmath_type<param_t> decay, add_math_t<param_t, update_t> step) {
  using opmath_t = at::opmath_type<param_t>;
  using add_t = add_math_t<param_t, update_t>;
  const auto apply = [&](int64_t j) {
    const opmath_t decayed = store(param + j, static_cast<opmath_t>(param[j]) * decay);
    store(param + j, std::fma(step, static_cast<add_t>(muon_cpu::widen(update[j])), static_cast<add_t>(decayed)));
  };
  if constexpr (kStreamed) {
    muon_cpu::for_each_prefetched<param_t>(count, apply, update, param);
  } else {
    for (int64_t j = 0; j < count; ++j) apply(j);
  }
}

// A tile of a transposed update is converted along the update's rows, transposed in 8 x 8 blocks, then applied along
// the parameter's rows: element by element, the transposing stores kept the tile loop scalar (a (12, 3072, 768)
// bucket's update took 21 ms, 14 ms this way; copying a 3072 x 768 bf16 update into the parameter's layout took
// 1.5 ms, then 0.7 to add, 2-core Xeon). A partial tile at an edge is padded with zeros, which are moved but never
// applied.
template <typename param_t, typename update_t>
MUON_VECTOR_CLONES void apply_transposed_tile(param_t* param, const update_t* update,
                                              const muon_cpu::TransposedTiles& tiles, int64_t tile,
                                              at::opmath_type<param_t> decay, add_math_t<param_t, update_t> step) {
  using add_t = add_math_t<param_t, update_t>;
  const muon_cpu::TilePlace place(tiles, tile);
  param += place.matrix_offset;
  update += place.matrix_offset;
  alignas(64) add_t read[kTile][kTile];  // [col][row]: the update's layout
  if (place.partial()) {
    std::memset(read, 0, sizeof(read));
  }
  for (int64_t col = 0; col < place.col_count; ++col) {
    const update_t* source = update + (place.first_col + col) * tiles.rows + place.first_row;
    for (int64_t row = 0; row < place.row_count; ++row) {
      read[col][row] = static_cast<add_t>(muon_cpu::widen(source[row]));
    }
  }
  alignas(64) add_t values[kTile][kTile];  // [row][col]: the parameter's
  muon_cpu::transpose_tile(read, values);
  for (int64_t row = 0; row < place.row_count; ++row) {
    apply_range<false>(param + (place.first_row + row) * tiles.cols + place.first_col, values[row], place.col_count,
                       decay, step);
  }
}

}  // namespace

void apply_update_cpu(at::TensorList params, at::TensorList updates, const at::Tensor& decay,
                      const at::Tensor& step_sizes) {
  const double* decays = decay.const_data_ptr<double>();
  const double* steps = step_sizes.const_data_ptr<double>();
  for (size_t i = 0; i < params.size(); ++i) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[i].scalar_type(), "apply_update_cpu", [&] {
      using param_t = scalar_t;
      using opmath_t = at::opmath_type<param_t>;
      auto* param = params[i].mutable_data_ptr<param_t>();
      const auto factor = static_cast<opmath_t>(decays[i]);
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, updates[i].scalar_type(), "apply_update_cpu", [&] {
        const auto* update = updates[i].const_data_ptr<scalar_t>();
        const auto step = static_cast<add_math_t<param_t, scalar_t>>(steps[i]);
        if (updates[i].is_contiguous()) {
          at::parallel_for(0, params[i].numel(), kGrainSize, [&](int64_t begin, int64_t end) {
            apply_range<true>(param + begin, update + begin, end - begin, factor, step);
          });
          return;
        }
        const muon_cpu::TransposedTiles tiles(params[i].size(-2), params[i].size(-1));
        const int64_t matrices = params[i].numel() / (tiles.rows * tiles.cols);
        at::parallel_for(0, matrices * tiles.per_matrix(), kGrainSize / (kTile * kTile), [&](int64_t begin,
                                                                                             int64_t end) {
          for (int64_t tile = begin; tile < end; ++tile) {
            apply_transposed_tile(param, update, tiles, tile, factor, step);
          }
        });
      });
    });
  }
}
