// AdamW's step on the CPU for moments kept in fewer bytes (bfloat16, or e4m3 codes with a scale per block, the second
// moment's holding its square root): block by block, both moments are read into float32, stepped with the parameter,
// and stored back rounded at random, in one pass. The composition this replaces (load the moments into working
// copies, torch's fused AdamW on them, store them back) took three passes, in chunks whose per-call costs added up.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "../common/stochastic_rounding.h"
#include "adamw_math_cpu.h"
#include "finite_cpu.h"
#include "moment_codes_cpu.h"
#include "torch_binding.h"

namespace {

using muon_cpu::AdamWRule;
using muon_cpu::step_entries;

MUON_VECTOR_CLONES void load_bfloat16_pair(float* __restrict__ m, float* __restrict__ v,
                                           const uint16_t* __restrict__ stored_m,
                                           const uint16_t* __restrict__ stored_v, int64_t first, int64_t length) {
  for (int64_t t = 0; t < length; ++t) {
    m[t] = c10::bit_cast<float>(static_cast<uint32_t>(stored_m[first + t]) << 16);
    v[t] = c10::bit_cast<float>(static_cast<uint32_t>(stored_v[first + t]) << 16);
  }
}

MUON_VECTOR_CLONES void store_bfloat16_pair(uint16_t* __restrict__ stored_m, uint16_t* __restrict__ stored_v,
                                            const float* __restrict__ m, const float* __restrict__ v,
                                            const uint32_t* __restrict__ bits, int64_t first, int64_t length) {
  for (int64_t t = 0; t < length; ++t) {
    stored_m[first + t] = muon_rounding::bfloat16_bits_rounded(m[t], bits[t]);
    stored_v[first + t] = muon_rounding::bfloat16_bits_rounded(v[t], bits[t]);
  }
}

// The first moment is zeroed where the second one's codes say 0 (see state_precision's AdamW path): else it would
// step by m / eps.
MUON_VECTOR_CLONES void load_code_pair(float* __restrict__ m, float* __restrict__ v, const uint8_t* __restrict__ codes_m,
                                       const uint8_t* __restrict__ codes_v, float scale_m, float scale_v,
                                       int64_t first, int64_t length, const muon_cpu::CodeValues& values) {
  for (int64_t t = 0; t < length; ++t) {
    const float root = values.of[codes_v[first + t]] * scale_v;
    v[t] = root * root;
    m[t] = v[t] == 0.0f ? 0.0f : values.of[codes_m[first + t]] * scale_m;
  }
}

// Both moments' codes, rounded with the same random bits (as two `store_moment_` calls round them), drawn once.
MUON_VECTOR_CLONES void store_code_pair(int8_t* codes_m, int8_t* codes_v, float* scale_m, float* scale_v,
                                        const float* m, float* v, int64_t first, int64_t length,
                                        const muon_cpu::Salt& salt) {
  uint32_t bits[kRoundedBlock];
  salt.fill(bits, first, length);
  muon_cpu::store_block(codes_m, scale_m, m, first, length, MomentCode::kE4m3, bits);
  for (int64_t t = 0; t < length; ++t) {
    v[t] = std::sqrt(v[t]);
  }
  muon_cpu::store_block(codes_v, scale_v, v, first, length, MomentCode::kE4m3Root, bits);
}

template <typename param_t, typename grad_t>
void step_bfloat16(param_t* param, const grad_t* grad, uint16_t* stored_m, uint16_t* stored_v, int64_t numel,
                   const AdamWRule& rule, const muon_cpu::Salt& salt) {
  at::parallel_for(0, numel, muon_cpu::kGrainSize, [&](int64_t begin, int64_t end) {
    float m[kRoundedBlock], v[kRoundedBlock];
    uint32_t bits[kRoundedBlock];
    for (int64_t first = begin; first < end; first += kRoundedBlock) {
      const int64_t length = std::min(kRoundedBlock, end - first);
      load_bfloat16_pair(m, v, stored_m, stored_v, first, length);
      step_entries(param + first, grad + first, m, v, length, rule);
      salt.fill(bits, first, length);
      store_bfloat16_pair(stored_m, stored_v, m, v, bits, first, length);
    }
  });
}

template <typename param_t, typename grad_t>
void step_codes(param_t* param, const grad_t* grad, int8_t* codes_m, int8_t* codes_v, float* scales_m,
                float* scales_v, const muon_cpu::Blocks& blocks, int64_t block_count, const AdamWRule& rule,
                const muon_cpu::Salt& salt) {
  static const muon_cpu::CodeValues e4m3(MomentCode::kE4m3);
  at::parallel_for(0, block_count, muon_cpu::kGrainSize / kRoundedBlock, [&](int64_t begin, int64_t end) {
    float m[kRoundedBlock], v[kRoundedBlock];
    for (int64_t block = begin; block < end; ++block) {
      const int64_t first = blocks.first(block), length = blocks.length(block);
      load_code_pair(m, v, reinterpret_cast<const uint8_t*>(codes_m), reinterpret_cast<const uint8_t*>(codes_v),
                     scales_m[block], scales_v[block], first, length, e4m3);
      step_entries(param + first, grad + first, m, v, length, rule);
      store_code_pair(codes_m, codes_v, scales_m + block, scales_v + block, m, v, first, length, salt);
    }
  });
}

}  // namespace

void adamw_rounded_cpu(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                       const std::optional<at::Tensor>& exp_avg_scales, at::Tensor& exp_avg_sq,
                       const std::optional<at::Tensor>& exp_avg_sq_scales, const at::Tensor& rounding_count,
                       const std::optional<at::Tensor>& row_positions,
                       const std::optional<at::Tensor>& column_positions, const at::Tensor& step, double lr,
                       double beta1, double beta2, double eps, double weight_decay) {
  const AdamWRule rule(lr, beta1, beta2, eps, weight_decay, static_cast<double>(*step.const_data_ptr<float>()));
  const muon_cpu::Salt salt{*rounding_count.const_data_ptr<int64_t>(),
                            muon_rounding::entry_positions(row_positions, column_positions, 0)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, param.scalar_type(), "adamw_rounded_cpu", [&] {
    using param_t = scalar_t;
    auto* param_data = param.mutable_data_ptr<param_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "adamw_rounded_cpu", [&] {
      const auto* grad_data = grad.const_data_ptr<scalar_t>();
      if (!exp_avg_scales.has_value()) {
        step_bfloat16(param_data, grad_data, reinterpret_cast<uint16_t*>(exp_avg.mutable_data_ptr<at::BFloat16>()),
                      reinterpret_cast<uint16_t*>(exp_avg_sq.mutable_data_ptr<at::BFloat16>()), param.numel(), rule,
                      salt);
        return;
      }
      step_codes(param_data, grad_data, exp_avg.mutable_data_ptr<int8_t>(), exp_avg_sq.mutable_data_ptr<int8_t>(),
                 exp_avg_scales->mutable_data_ptr<float>(), exp_avg_sq_scales->mutable_data_ptr<float>(),
                 muon_cpu::Blocks(exp_avg, *exp_avg_scales), exp_avg_scales->numel(), rule, salt);
    });
  });
}
