// Muon's momentum step on the CPU for momentum kept in fewer bytes: bfloat16, or int8 codes with a float32 scale per
// block. For each tensor, one parallel pass checks the gradient is finite; one more reads the stored momentum, steps
// it in float32, writes the update from that float32 value, and stores the momentum back stochastically rounded:
// per entry for bfloat16, per block (its largest magnitude sets the new scale) for int8.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "../common/stochastic_rounding.h"
#include "finite_cpu.h"
#include "moment_codes_cpu.h"
#include "momentum_math_cpu.h"
#include "torch_binding.h"

namespace {

using muon_cpu::Lerp;
using muon_cpu::store;

// What every entry's step needs besides its own values: the lerps, Nesterov, and the salt of the random bits. The
// loops take it by value: through a reference GCC reloads its fields after each store (the stores might alias them),
// which kept the bfloat16 loop scalar, 3x slower.
struct StepRule {
  Lerp<float> toward_grad;
  Lerp<float> toward_buffer;
  bool nesterov;
  muon_cpu::Salt salt;

  // The new momentum (float32, before rounding) from its stored value; writes the update from it.
  template <typename grad_t, typename update_t>
  C10_ALWAYS_INLINE float step(float stored, grad_t grad, update_t* update) const {
    const float g = static_cast<float>(grad);
    const float momentum = toward_grad(stored, g);
    store(update, nesterov ? toward_buffer(g, momentum) : momentum);
    return momentum;
  }

};

// Blocks ahead that a block's streams are prefetched: kPrefetchBytes of a float32 gradient.
constexpr int64_t kAheadBlocks = muon_cpu::kPrefetchBytes / (kRoundedBlock * static_cast<int64_t>(sizeof(float)));

// The streams of entries [first, first + count), before a block loop reaches them (see prefetch_entries).
template <typename stored_t, typename grad_t, typename update_t>
C10_ALWAYS_INLINE void prefetch_block(const stored_t* stored, const grad_t* grad, const update_t* update, int64_t first,
                                      int64_t count) {
  muon_cpu::prefetch_entries<true>(stored + first, count);
  muon_cpu::prefetch_entries<false>(grad + first, count);
  muon_cpu::prefetch_entries<true>(update + first, count);
}

template <typename grad_t, typename update_t>
MUON_VECTOR_CLONES void step_bfloat16_range(uint16_t* __restrict__ buffer, const grad_t* __restrict__ grad,
                                            update_t* __restrict__ update, int64_t begin, int64_t end,
                                            const StepRule rule) {
  uint32_t bits[kRoundedBlock];
  for (int64_t first = begin; first < end; first += kRoundedBlock) {
    const int64_t length = std::min(kRoundedBlock, end - first);
    const int64_t ahead = first + kAheadBlocks * kRoundedBlock;
    if (ahead + kRoundedBlock <= end) {
      prefetch_block(buffer, grad, update, ahead, kRoundedBlock);
    }
    rule.salt.fill(bits, first, length);
    for (int64_t t = 0; t < length; ++t) {
      const int64_t j = first + t;
      const float stored = c10::bit_cast<float>(static_cast<uint32_t>(buffer[j]) << 16);
      buffer[j] = muon_rounding::bfloat16_bits_rounded(rule.step(stored, grad[j], update + j), bits[t]);
    }
  }
}

// One block of int8 codes, entries [first, first + length): stepped into float32, then encoded under a new scale.
template <typename grad_t, typename update_t>
MUON_VECTOR_CLONES void step_int8_block(int8_t* __restrict__ codes, float* __restrict__ scale,
                                        const grad_t* __restrict__ grad, update_t* __restrict__ update, int64_t first,
                                        int64_t length, const StepRule rule) {
  float momentum[kRoundedBlock];
  for (int64_t t = 0; t < length; ++t) {
    const int64_t j = first + t;
    momentum[t] = rule.step(static_cast<float>(codes[j]) * *scale, grad[j], update + j);
  }
  muon_cpu::store_block(codes, scale, momentum, first, length, MomentCode::kLinear, rule.salt);
}

template <typename grad_t, typename update_t>
void step_tensor(const at::Tensor& buffer, const std::optional<at::Tensor>& scales, const grad_t* grad,
                 update_t* update, const StepRule& rule) {
  const int64_t numel = buffer.numel();
  if (!scales.has_value()) {
    auto* stored = reinterpret_cast<uint16_t*>(buffer.mutable_data_ptr<at::BFloat16>());
    at::parallel_for(0, numel, muon_cpu::kGrainSize, [&](int64_t begin, int64_t end) {
      step_bfloat16_range(stored, grad, update, begin, end, rule);
    });
    return;
  }
  auto* codes = buffer.mutable_data_ptr<int8_t>();
  float* block_scales = scales->mutable_data_ptr<float>();
  const muon_cpu::Blocks blocks(buffer, *scales);
  at::parallel_for(0, scales->numel(), muon_cpu::kGrainSize / kRoundedBlock, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      if (block + kAheadBlocks < end) {
        prefetch_block(codes, grad, update, blocks.first(block + kAheadBlocks), blocks.length(block + kAheadBlocks));
      }
      step_int8_block(codes, block_scales + block, grad, update, blocks.first(block), blocks.length(block), rule);
    }
  });
}

}  // namespace

void muon_momentum_rounded_cpu(at::TensorList momentum_buffers, const OptionalTensors& scales, at::TensorList grads,
                               at::TensorList updates, const at::Tensor& finite, at::TensorList rounding_counts,
                               const OptionalTensors& row_positions, const OptionalTensors& column_positions,
                               double beta, bool nesterov) {
  float* flags = finite.mutable_data_ptr<float>();
  for (size_t i = 0; i < grads.size(); ++i) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grads[i].scalar_type(), "muon_momentum_rounded_cpu", [&] {
      using grad_t = scalar_t;
      const auto* grad = grads[i].const_data_ptr<grad_t>();
      const bool grad_finite = muon_cpu::all_finite(grad, grads[i].numel());
      flags[i] = grad_finite ? 1.0f : 0.0f;
      if (!grad_finite) {
        updates[i].zero_();  // the stored momentum and its scales keep their values
        return;
      }
      const muon_cpu::Salt salt{*rounding_counts[i].const_data_ptr<int64_t>(),
                                muon_rounding::entry_positions(row_positions.get(i), column_positions.get(i), 0)};
      const StepRule rule{Lerp<float>(1.0 - beta), Lerp<float>(beta), nesterov, salt};
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, updates[i].scalar_type(), "muon_momentum_rounded_cpu",
                                      [&] {
        step_tensor(momentum_buffers[i], scales.get(i), grad, updates[i].mutable_data_ptr<scalar_t>(), rule);
      });
    });
  }
}
