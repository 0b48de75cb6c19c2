// AdamW's step on the CPU for float32 and bfloat16 parameters whose moments are stored as they are (in the
// parameter's dtype; gradients of another dtype are converted), each parameter's gradient checked for NaN and Inf just
// before its own update: the guard and the update in one call. A separate check of every gradient first read the
// largest ones back from memory a whole pass ahead of their updates, and cost a call and the flags' round trip.
// float16 stays with torch's fused kernel: without F16C conversions (which the x86-64-v3 clone could use only through
// intrinsics) this loop took 13x its time on GPT-2's embedding.
#include <cstdint>

#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "adamw_math_cpu.h"
#include "finite_cpu.h"
#include "torch_binding.h"

namespace {

struct Hyperparameters {
  double lr, beta1, beta2, eps, weight_decay;
};

// One parameter: skipped (left as it was) where its flag says so, or where `check` finds a NaN or Inf in its
// gradient (the flag is then written); otherwise its step count moves by one and its entries take the step.
template <typename value_t>
void step_checked(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, const at::Tensor& step, float& skipped, bool check,
                  const Hyperparameters& h) {
  const auto* grad_data = grad.const_data_ptr<value_t>();
  if (check) {
    skipped = muon_cpu::all_finite(grad_data, grad.numel()) ? 0.0f : 1.0f;
  }
  if (skipped != 0.0f) {
    return;
  }
  float* count = step.mutable_data_ptr<float>();
  *count += 1.0f;
  const muon_cpu::AdamWRule rule(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, static_cast<double>(*count));
  auto* param_data = param.mutable_data_ptr<value_t>();
  auto* m = exp_avg.mutable_data_ptr<value_t>();
  auto* v = exp_avg_sq.mutable_data_ptr<value_t>();
  at::parallel_for(0, param.numel(), muon_cpu::kGrainSize, [&](int64_t begin, int64_t end) {
    muon_cpu::step_entries</*kStreamed=*/true>(param_data + begin, grad_data + begin, m + begin, v + begin,
                                                 end - begin, rule);
  });
}

}  // namespace

void adamw_checked_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                       at::TensorList exp_avg_sqs, at::TensorList steps, const at::Tensor& found_inf, bool check,
                       at::ArrayRef<double> lr, double beta1, double beta2, double eps,
                       at::ArrayRef<double> weight_decay) {
  float* skipped = found_inf.mutable_data_ptr<float>();
  for (size_t i = 0; i < params.size(); ++i) {
    const Hyperparameters h{lr[lr.size() == 1 ? 0 : i], beta1, beta2, eps,
                            weight_decay[weight_decay.size() == 1 ? 0 : i]};
    // The loop walks memory as if it were contiguous: a strided tensor (a column, a transposed weight) steps as its
    // contiguous copy, written back. Here rather than in Python, where making sure of it took GPT-2 small's 97 AdamW
    // tensors (at 1/96 width) from 1.06x to 1.20x fused AdamW's step time (~55 us; 2-core AMD EPYC, paired).
    const at::Tensor param = params[i].contiguous();
    const at::Tensor exp_avg = exp_avgs[i].contiguous();
    const at::Tensor exp_avg_sq = exp_avg_sqs[i].contiguous();
    const at::Tensor grad = grads[i].to(params[i].scalar_type()).contiguous();
    AT_DISPATCH_V2(params[i].scalar_type(), "adamw_checked_cpu", AT_WRAP([&] {
      step_checked<scalar_t>(param, grad, exp_avg, exp_avg_sq, steps[i], skipped[i], check, h);
    }), at::kFloat, at::kBFloat16);
    for (const auto& [copy, original] : {std::pair{param, params[i]}, std::pair{exp_avg, exp_avgs[i]},
                                         std::pair{exp_avg_sq, exp_avg_sqs[i]}}) {
      if (!copy.is_same(original)) {
        original.copy_(copy);
      }
    }
  }
}
