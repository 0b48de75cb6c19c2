#pragma once
// AdamW's element math on the CPU, torch's fused AdamW formula with its constants in float32: shared by the op that
// steps moments stored as they are (`adamw_checked_`) and the one that steps moments stored rounded
// (`adamw_rounded_`).
#include <cmath>
#include <cstdint>

#include "momentum_math_cpu.h"
#include "vector_clones.h"

namespace muon_cpu {

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

// One entry of a parameter with its gradient and its moments m and v, in place. As torch's kernel does for 16-bit
// tensors, the parameter's step uses the moments before they are rounded to their dtype. kFromStart is the lerp's
// formula (Lerp::from_start) fixed at compile time: chosen per element, it kept GCC from vectorizing bfloat16 loops.
template <bool kFromStart, typename param_t, typename grad_t, typename moment_t>
C10_ALWAYS_INLINE void step_entry(param_t* __restrict__ param, const grad_t* __restrict__ grad,
                                  moment_t* __restrict__ m, moment_t* __restrict__ v, const AdamWRule& rule) {
  const auto g = static_cast<float>(widen(*grad));
  const auto decayed = static_cast<float>(widen(*param)) * rule.decay;
  const auto start = static_cast<float>(widen(*m));
  const float exp_avg = (kFromStart ? start : g) + rule.toward_grad.coefficient * (g - start);
  const float exp_avg_sq = rule.beta2 * static_cast<float>(widen(*v)) + rule.one_minus_beta2 * g * g;
  const float denominator = std::sqrt(exp_avg_sq) / rule.bias2_root + rule.eps;
  store(param, decayed - rule.step_size * exp_avg / denominator);
  store(m, exp_avg);
  store(v, exp_avg_sq);
}

// `length` entries. kStreamed: the four tensors stream from memory (not a block's buffers in cache), and each is
// prefetched ahead of its reads (see for_each_prefetched). The rule is taken by value: through a reference GCC
// reloads its fields after each store (see muon_momentum_rounded_cpu.cpp).
template <bool kFromStart, bool kStreamed, typename param_t, typename grad_t, typename moment_t>
MUON_VECTOR_CLONES void step_entries_with(param_t* __restrict__ param, const grad_t* __restrict__ grad,
                                          moment_t* __restrict__ m, moment_t* __restrict__ v, int64_t length,
                                          const AdamWRule rule) {
  const auto step = [&](int64_t t) { step_entry<kFromStart>(param + t, grad + t, m + t, v + t, rule); };
  if constexpr (kStreamed) {
    for_each_prefetched<param_t>(length, step, grad, param, m, v);
  } else {
    for (int64_t t = 0; t < length; ++t) step(t);
  }
}

// step_entries_with, its lerp formula picked once for the call.
template <bool kStreamed = false, typename param_t, typename grad_t, typename moment_t>
void step_entries(param_t* param, const grad_t* grad, moment_t* m, moment_t* v, int64_t length,
                  const AdamWRule& rule) {
  if (rule.toward_grad.from_start) {
    step_entries_with<true, kStreamed>(param, grad, m, v, length, rule);
  } else {
    step_entries_with<false, kStreamed>(param, grad, m, v, length, rule);
  }
}

}  // namespace muon_cpu
