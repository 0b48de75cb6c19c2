#pragma once

#include <optional>

#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>

// One implementation per backend, each defined in kernels-src/<backend>/. They receive arguments that
// torch_binding.cpp has already validated (same device, matching shapes, supported dtypes, contiguous where needed).
using MuonMomentumImpl = void (*)(at::TensorList momentum_buffers, at::TensorList grads, at::TensorList updates,
                                  const at::Tensor& finite, double beta, bool nesterov);

void muon_momentum_cpu(at::TensorList momentum_buffers, at::TensorList grads, at::TensorList updates,
                       const at::Tensor& finite, double beta, bool nesterov);

void muon_momentum_cuda(at::TensorList momentum_buffers, at::TensorList grads, at::TensorList updates,
                        const at::Tensor& finite, double beta, bool nesterov);

// Muon's momentum step on state kept in fewer bytes (torch-ext/optimizer/state_precision.py says why and how):
// momentum_buffers[i] is bfloat16 (scales[i] absent) or int8 linear codes -127..127 with a float32 scale per block of
// kRoundedBlock entries along the last dim (scales[i] of shape (*shape[:-1], ceil(shape[-1] / kRoundedBlock))). The
// momentum is stepped in float32 from the stored values, the update written from that float32 value, and the new
// momentum stored back rounded at random with bits hashed from each entry's position in the whole tensor
// (row_positions[i] and column_positions[i], int64 vectors, as muon_rounding::EntryPositions reads them; its index
// when absent) and *rounding_counts[i] (int64, read on the device). A non-finite gradient leaves buffer and scales
// untouched and zeroes the update; finite[i] tells which. The counts are not moved: the caller moves them.
constexpr int64_t kRoundedBlock = 256;

using OptionalTensors = c10::List<std::optional<at::Tensor>>;

using MuonMomentumRoundedImpl = void (*)(at::TensorList momentum_buffers, const OptionalTensors& scales,
                                         at::TensorList grads, at::TensorList updates, const at::Tensor& finite,
                                         at::TensorList rounding_counts, const OptionalTensors& row_positions,
                                         const OptionalTensors& column_positions, double beta, bool nesterov);

void muon_momentum_rounded_cpu(at::TensorList momentum_buffers, const OptionalTensors& scales, at::TensorList grads,
                               at::TensorList updates, const at::Tensor& finite, at::TensorList rounding_counts,
                               const OptionalTensors& row_positions, const OptionalTensors& column_positions,
                               double beta, bool nesterov);

void muon_momentum_rounded_cuda(at::TensorList momentum_buffers, const OptionalTensors& scales, at::TensorList grads,
                                at::TensorList updates, const at::Tensor& finite, at::TensorList rounding_counts,
                                const OptionalTensors& row_positions, const OptionalTensors& column_positions,
                                double beta, bool nesterov);

// A moment kept in fewer bytes, read into and written from float32, for the optimizer steps that do their math on a
// float32 working copy (AdamW's, through torch's fused kernel). `code` names the stored form: "bfloat16" (a bfloat16
// tensor, no scales), or int8 codes with a float32 scale per block as for the momentum: "linear" (-127..127),
// "e4m3" (float8 e4m3 values) or "e4m3_root" (e4m3 values of the square root). Writing rounds at random with bits
// hashed from each entry's position (row_positions and column_positions from position_offset on, as
// muon_rounding::EntryPositions reads them, or position_offset + its index when absent) and
// *rounding_count; nothing is written where *taken (float32, one element) is 0.
enum class MomentCode { kBFloat16, kLinear, kE4m3, kE4m3Root };

using LoadMomentImpl = void (*)(at::Tensor& out, const at::Tensor& stored, const std::optional<at::Tensor>& scales,
                                MomentCode code);
using StoreMomentImpl = void (*)(at::Tensor& stored, const std::optional<at::Tensor>& scales, const at::Tensor& values,
                                 const at::Tensor& rounding_count, const std::optional<at::Tensor>& row_positions,
                                 const std::optional<at::Tensor>& column_positions, int64_t position_offset,
                                 const at::Tensor& taken, MomentCode code);

void load_moment_cpu(at::Tensor& out, const at::Tensor& stored, const std::optional<at::Tensor>& scales,
                     MomentCode code);
void store_moment_cpu(at::Tensor& stored, const std::optional<at::Tensor>& scales, const at::Tensor& values,
                      const at::Tensor& rounding_count, const std::optional<at::Tensor>& row_positions,
                      const std::optional<at::Tensor>& column_positions, int64_t position_offset,
                      const at::Tensor& taken, MomentCode code);
void load_moment_cuda(at::Tensor& out, const at::Tensor& stored, const std::optional<at::Tensor>& scales,
                      MomentCode code);
void store_moment_cuda(at::Tensor& stored, const std::optional<at::Tensor>& scales, const at::Tensor& values,
                       const at::Tensor& rounding_count, const std::optional<at::Tensor>& row_positions,
                       const std::optional<at::Tensor>& column_positions, int64_t position_offset,
                       const at::Tensor& taken, MomentCode code);

// out = alpha * X X^T + beta * C (beta and C ignored when C is absent), out and C symmetric: X (m, k) or (B, m, k).
using SymmetricGramImpl = void (*)(at::Tensor& out, const at::Tensor& X, const std::optional<at::Tensor>& C,
                                   double alpha, double beta);

void symmetric_gram_cpu(at::Tensor& out, const at::Tensor& X, const std::optional<at::Tensor>& C, double alpha,
                        double beta);

void symmetric_gram_cuda(at::Tensor& out, const at::Tensor& X, const std::optional<at::Tensor>& C, double alpha,
                         double beta);

// finite[i] = 1.0 when tensors[i] holds no NaN or +-Inf, else 0.0; the tensors are only read.
using FiniteFlagsImpl = void (*)(at::TensorList tensors, const at::Tensor& finite);

void finite_flags_cpu(at::TensorList tensors, const at::Tensor& finite);

// On the GPU, the first pass of `muon_momentum_rounded_` (a kernel per tensor); the `finite_flags_` op itself has
// no CUDA kernel: there torch's multi-tensor norm checks many tensors in a few launches (native.finite_flags).
void finite_flags_cuda(at::TensorList tensors, const at::Tensor& finite);

// sums[i] = the sum of the squares of tensors[i]'s elements, accumulated in float64 (sums: float64, one per tensor,
// where the tensors are); the tensors are only read.
using SquaredNormsImpl = void (*)(at::TensorList tensors, const at::Tensor& sums);

void squared_norms_cpu(at::TensorList tensors, const at::Tensor& sums);

// params[i] <- params[i] * decay[i] then <- params[i] + step_sizes[i] * updates[i], each rounded to the parameter's
// dtype (decay and step_sizes: float64, one per parameter, on the host); updates[i] of any supported dtype,
// contiguous or the transpose of a contiguous tensor (its last two dims swapped).
using ApplyUpdateImpl = void (*)(at::TensorList params, at::TensorList updates, const at::Tensor& decay,
                                 const at::Tensor& step_sizes);

void apply_update_cpu(at::TensorList params, at::TensorList updates, const at::Tensor& decay,
                      const at::Tensor& step_sizes);

// AdaMuon's normalization of each entry, in place: moments[i] <- moments[i] * decays[i] + one_minus_beta * u²,
// then updates[i] <- u / (sqrt(moments[i] / corrections[i]) + eps), with u = updates[i]'s entry; squares[i] <- the
// sum of squares of the stored result. updates[i] is contiguous or (..., rows, cols) stored as the transpose of a
// contiguous tensor; moments[i] float32 or float64, contiguous, of the update's shape; decays, corrections and squares
// float64, one per tensor, on the host.
using NormalizeElementsImpl = void (*)(at::TensorList updates, at::TensorList moments, const at::Tensor& decays,
                                       const at::Tensor& corrections, double one_minus_beta, double eps,
                                       const at::Tensor& squares);

void normalize_elements_cpu(at::TensorList updates, at::TensorList moments, const at::Tensor& decays,
                            const at::Tensor& corrections, double one_minus_beta, double eps,
                            const at::Tensor& squares);

// NorMuon's normalization of each row (output neuron), in place: with s the sum of a row's squares and n its length,
// the row's moment <- moment * decays[i] + one_minus_beta * s / n, then the row <- row / (sqrt(moment /
// corrections[i]) + eps); squares[i] <- the sum of squares of the stored result. updates[i] is (..., rows, cols),
// contiguous or the transpose of a contiguous tensor; moments[i] float32 or float64, contiguous,
// one entry per row; decays, corrections and squares float64, one per tensor, on the host.
using NormalizeRowsImpl = void (*)(at::TensorList updates, at::TensorList moments, const at::Tensor& decays,
                                   const at::Tensor& corrections, double one_minus_beta, double eps,
                                   const at::Tensor& squares);

void normalize_rows_cpu(at::TensorList updates, at::TensorList moments, const at::Tensor& decays,
                        const at::Tensor& corrections, double one_minus_beta, double eps, const at::Tensor& squares);

// One AdamW step of a parameter whose moments are stored in fewer bytes, both in the same form: bfloat16 (no scales),
// or int8 e4m3 codes with a float32 scale per block of kRoundedBlock entries along the last dim, the second moment's
// codes holding its square root. Read, stepped in float32 with the parameter (lr, betas, eps and decoupled
// weight_decay as torch's AdamW; *step, float32, already counts this step), and stored back rounded at random as
// `store_moment_` does, salted by *rounding_count and each entry's position (row_positions and column_positions, or
// its index). The count is not moved.
using AdamWRoundedImpl = void (*)(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                                  const std::optional<at::Tensor>& exp_avg_scales, at::Tensor& exp_avg_sq,
                                  const std::optional<at::Tensor>& exp_avg_sq_scales, const at::Tensor& rounding_count,
                                  const std::optional<at::Tensor>& row_positions,
                                  const std::optional<at::Tensor>& column_positions, const at::Tensor& step, double lr,
                                  double beta1, double beta2, double eps, double weight_decay);

void adamw_rounded_cpu(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                       const std::optional<at::Tensor>& exp_avg_scales, at::Tensor& exp_avg_sq,
                       const std::optional<at::Tensor>& exp_avg_sq_scales, const at::Tensor& rounding_count,
                       const std::optional<at::Tensor>& row_positions,
                       const std::optional<at::Tensor>& column_positions, const at::Tensor& step, double lr,
                       double beta1, double beta2, double eps, double weight_decay);

// AdamW's step (torch's fused AdamW arithmetic, decoupled weight decay; bfloat16 computed in float32) on parameters
// whose moments are stored as they are: params[i], grads[i], exp_avgs[i] and exp_avg_sqs[i] contiguous, of one shape
// and one dtype, float32 or bfloat16.
// found_inf (float32, one per parameter): with `check`, written, 1.0 where grads[i] holds a NaN or Inf; without,
// read. A parameter flagged 1.0 is left as it was; the others' steps[i] (one float32) move by one before their
// update. lr and weight_decay: one value for every parameter, or one per parameter.
using AdamWCheckedImpl = void (*)(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                                  at::TensorList exp_avg_sqs, at::TensorList steps, const at::Tensor& found_inf,
                                  bool check, at::ArrayRef<double> lr, double beta1, double beta2, double eps,
                                  at::ArrayRef<double> weight_decay);

void adamw_checked_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                       at::TensorList exp_avg_sqs, at::TensorList steps, const at::Tensor& found_inf, bool check,
                       at::ArrayRef<double> lr, double beta1, double beta2, double eps,
                       at::ArrayRef<double> weight_decay);
