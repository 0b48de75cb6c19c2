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
#include "finite_cpu.h"
#include "moment_codes_cpu.h"
#include "momentum_math_cpu.h"
#include "torch_binding.h"

namespace {

using muon_cpu::Lerp;
using muon_cpu::store;
using muon_cpu::widen;

// AdamW's constants for this step, in float32 as torch's CPU kernel applies them; the bias corrections are computed
// in double first (1 - beta2^step loses most of its digits in float32 when beta2 is near 1).
struct AdamWRule {
  Lerp<float> toward_grad;  // exp_avg.lerp_(grad, 1 - beta1)
  float beta2;
  float one_minus_beta2;
  float decay;       // 1 - lr * weight_decay
  float step_size;   // lr / (1 - beta1^step)
  float bias2_root;  // sqrt(1 - beta2^step)
  float eps;

  AdamWRule(double lr, double beta1, double beta2, double eps, double weight_decay, double step)
      : toward_grad(1.0 - beta1),
        beta2(static_cast<float>(beta2)),
        one_minus_beta2(static_cast<float>(1.0 - beta2)),
        decay(static_cast<float>(1.0 - lr * weight_decay)),
        step_size(static_cast<float>(lr / (1.0 - std::pow(beta1, step)))),
        bias2_root(static_cast<float>(std::sqrt(1.0 - std::pow(beta2, step)))),
        eps(static_cast<float>(eps)) {}
};

// Entries [first, first + length) of the parameter, with their moments m and v (float32, indexed from 0) in place.
// Taken by value: through a reference GCC reloads the fields after each store (see muon_momentum_rounded_cpu.cpp).
template <typename param_t, typename grad_t>
MUON_VECTOR_CLONES void step_entries(param_t* __restrict__ param, const grad_t* __restrict__ grad,
                                     float* __restrict__ m, float* __restrict__ v, int64_t first, int64_t length,
                                     const AdamWRule rule) {
  for (int64_t t = 0; t < length; ++t) {
    const auto g = static_cast<float>(widen(grad[first + t]));
    const auto decayed = static_cast<float>(widen(param[first + t])) * rule.decay;
    const float exp_avg = rule.toward_grad(m[t], g);
    const float exp_avg_sq = rule.beta2 * v[t] + rule.one_minus_beta2 * g * g;
    const float denominator = std::sqrt(exp_avg_sq) / rule.bias2_root + rule.eps;
    store(param + first + t, decayed - rule.step_size * exp_avg / denominator);
    m[t] = exp_avg;
    v[t] = exp_avg_sq;
  }
}

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
      step_entries(param, grad, m, v, first, length, rule);
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
      step_entries(param, grad, m, v, first, length, rule);
      store_code_pair(codes_m, codes_v, scales_m + block, scales_v + block, m, v, first, length, salt);
    }
  });
}

}  // namespace

void adamw_rounded_cpu(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                       const std::optional<at::Tensor>& exp_avg_scales, at::Tensor& exp_avg_sq,
                       const std::optional<at::Tensor>& exp_avg_sq_scales, const at::Tensor& rounding_count,
                       const std::optional<at::Tensor>& positions, const at::Tensor& step, double lr, double beta1,
                       double beta2, double eps, double weight_decay) {
  const AdamWRule rule(lr, beta1, beta2, eps, weight_decay, static_cast<double>(*step.const_data_ptr<float>()));
  const muon_cpu::Salt salt{*rounding_count.const_data_ptr<int64_t>(),
                            positions.has_value() ? positions->const_data_ptr<int64_t>() : nullptr, 0};
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
