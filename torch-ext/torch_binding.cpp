#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/library.h>

#include "registration.h"
#include "torch_binding.h"

namespace {

bool is_supported_dtype(c10::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf;
}

// The layouts the CPU ops read a tall matrix's Newton-Schulz result in: computed on its transpose, it is that
// transpose's contiguous memory.
bool is_contiguous_or_transposed(const at::Tensor& tensor) {
  return tensor.is_contiguous() || (tensor.dim() >= 2 && tensor.mT().is_contiguous());
}

void check_tensor(const at::Tensor& tensor, const char* name, size_t index, const at::Tensor& finite) {
  TORCH_CHECK_VALUE(tensor.device() == finite.device(), "muon_momentum_: ", name, "[", index, "] is on ",
                    tensor.device(), " but finite is on ", finite.device());
  TORCH_CHECK_VALUE(is_supported_dtype(tensor.scalar_type()), "muon_momentum_: ", name, "[", index,
                    "] has dtype ", tensor.scalar_type(), " (expected float32, float64, bfloat16 or float16)");
  TORCH_CHECK_VALUE(tensor.is_contiguous(), "muon_momentum_: ", name, "[", index, "] must be contiguous");
}

// A shard's positions in the whole tensor (muon_rounding::EntryPositions): row and column positions, both int64
// vectors, contiguous, on `device`, covering the `count` entries of a write that starts `offset` entries into the
// shard (an empty shard's columns may be empty: nothing is divided by their count); or neither. `index` is the suffix
// of a list's item ("[2]"), else empty.
void check_positions(const char* op, const std::string& index, const std::optional<at::Tensor>& rows,
                     const std::optional<at::Tensor>& columns, int64_t offset, int64_t count,
                     const c10::Device& device) {
  TORCH_CHECK_VALUE(rows.has_value() == columns.has_value(), op, ": row_positions", index, " and column_positions",
                    index, " must be given together");
  if (!rows.has_value()) {
    return;
  }
  for (const auto& [name, positions] : {std::pair{"row_positions", *rows}, std::pair{"column_positions", *columns}}) {
    TORCH_CHECK_VALUE(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous() &&
                          positions.device() == device,
                      op, ": ", name, index, " must be a contiguous 1D int64 tensor on ", device, ", got ",
                      positions.scalar_type(), " of shape ", positions.sizes(), " on ", positions.device());
  }
  TORCH_CHECK_VALUE(offset + count <= rows->numel() * columns->numel(), op,
                    ": row_positions", index, " and column_positions", index, " (", rows->numel(), " and ",
                    columns->numel(), " entries) do not cover entries ", offset, " to ", offset + count);
}

// The per-tensor flags every op writes (or reads): one float32 per tensor, where the tensors are.
void check_flags(const char* op, const at::Tensor& finite, size_t count, const char* name = "finite") {
  TORCH_CHECK_VALUE(finite.scalar_type() == at::kFloat && finite.dim() == 1 && finite.is_contiguous() &&
                        finite.numel() == static_cast<int64_t>(count),
                    op, ": ", name, " must be a contiguous float32 tensor of shape (", count, "), got ",
                    finite.scalar_type(), " of shape ", finite.sizes());
}

// The rules both momentum ops share: one grad and one update per buffer, the flags, and beta.
void check_momentum_lists(const char* op, at::TensorList momentum_buffers, at::TensorList grads,
                          at::TensorList updates, const at::Tensor& finite, double beta) {
  const size_t count = momentum_buffers.size();
  TORCH_CHECK_VALUE(grads.size() == count, op, ": grads has ", grads.size(), " tensors but momentum_buffers has ",
                    count);
  TORCH_CHECK_VALUE(updates.size() == count, op, ": updates has ", updates.size(),
                    " tensors but momentum_buffers has ", count);
  check_flags(op, finite, count);
  TORCH_CHECK_VALUE(std::isfinite(beta) && beta >= 0.0 && beta <= 1.0, op, ": beta must be in [0, 1], got ", beta);
}

// Shared by every backend, so the rules cannot drift between CPU and CUDA.
void check_muon_momentum_args(at::TensorList momentum_buffers, at::TensorList grads, at::TensorList updates,
                              const at::Tensor& finite, double beta) {
  check_momentum_lists("muon_momentum_", momentum_buffers, grads, updates, finite, beta);
  for (size_t i = 0; i < momentum_buffers.size(); ++i) {
    check_tensor(momentum_buffers[i], "momentum_buffers", i, finite);
    check_tensor(grads[i], "grads", i, finite);
    check_tensor(updates[i], "updates", i, finite);
    TORCH_CHECK_VALUE(grads[i].sizes() == momentum_buffers[i].sizes(), "muon_momentum_: grads[", i, "] has shape ",
                      grads[i].sizes(), " but momentum_buffers[", i, "] has shape ", momentum_buffers[i].sizes());
    TORCH_CHECK_VALUE(grads[i].scalar_type() == momentum_buffers[i].scalar_type(), "muon_momentum_: grads[", i,
                      "] has dtype ", grads[i].scalar_type(), " but momentum_buffers[", i, "] has dtype ",
                      momentum_buffers[i].scalar_type());
    TORCH_CHECK_VALUE(updates[i].sizes() == momentum_buffers[i].sizes(), "muon_momentum_: updates[", i,
                      "] has shape ", updates[i].sizes(), " but momentum_buffers[", i, "] has shape ",
                      momentum_buffers[i].sizes());
  }
}

// The stored forms' extra arguments, on top of check_muon_momentum_args' rules for the lists and the flags.
void check_rounded_item(const at::Tensor& buffer, const std::optional<at::Tensor>& scales, const at::Tensor& count,
                        const std::optional<at::Tensor>& row_positions,
                        const std::optional<at::Tensor>& column_positions, size_t i, const at::Tensor& finite) {
  const bool quantized = buffer.scalar_type() == at::kChar;
  TORCH_CHECK_VALUE(quantized || buffer.scalar_type() == at::kBFloat16, "muon_momentum_rounded_: momentum_buffers[",
                    i, "] has dtype ", buffer.scalar_type(), " (expected bfloat16, or int8 codes with scales)");
  TORCH_CHECK_VALUE(buffer.device() == finite.device(), "muon_momentum_rounded_: momentum_buffers[", i, "] is on ",
                    buffer.device(), " but finite is on ", finite.device());
  TORCH_CHECK_VALUE(buffer.is_contiguous(), "muon_momentum_rounded_: momentum_buffers[", i, "] must be contiguous");
  TORCH_CHECK_VALUE(scales.has_value() == quantized, "muon_momentum_rounded_: scales[", i, "] must be ",
                    quantized ? "given for int8 codes" : "None for a bfloat16 buffer");
  if (quantized) {
    TORCH_CHECK_VALUE(buffer.dim() >= 1, "muon_momentum_rounded_: momentum_buffers[", i,
                      "] holds int8 codes, which need at least one dim, got a 0-dim tensor");
    std::vector<int64_t> expected(buffer.sizes().begin(), buffer.sizes().end());
    expected.back() = (expected.back() + kRoundedBlock - 1) / kRoundedBlock;
    TORCH_CHECK_VALUE(scales->scalar_type() == at::kFloat && scales->device() == finite.device() &&
                          scales->is_contiguous() && scales->sizes() == c10::IntArrayRef(expected),
                      "muon_momentum_rounded_: scales[", i, "] must be a contiguous float32 tensor of shape ",
                      c10::IntArrayRef(expected), " on ", finite.device(), ", got ", scales->scalar_type(), " of shape ",
                      scales->sizes(), " on ", scales->device());
  }
  TORCH_CHECK_VALUE(count.scalar_type() == at::kLong && count.numel() == 1 && count.device() == finite.device(),
                    "muon_momentum_rounded_: rounding_counts[", i, "] must be one int64 on ", finite.device(), ", got ",
                    count.scalar_type(), " of shape ", count.sizes(), " on ", count.device());
  check_positions("muon_momentum_rounded_", "[" + std::to_string(i) + "]", row_positions, column_positions, 0,
                  buffer.numel(), finite.device());
}

// Shared by every backend. The grads may have any supported dtype, whatever the stored form.
void check_muon_momentum_rounded_args(at::TensorList momentum_buffers, const OptionalTensors& scales,
                                      at::TensorList grads, at::TensorList updates, const at::Tensor& finite,
                                      at::TensorList rounding_counts, const OptionalTensors& row_positions,
                                      const OptionalTensors& column_positions, double beta) {
  const size_t count = momentum_buffers.size();
  TORCH_CHECK_VALUE(scales.size() == count && rounding_counts.size() == count && row_positions.size() == count &&
                        column_positions.size() == count,
                    "muon_momentum_rounded_: scales, rounding_counts, row_positions and column_positions have ",
                    scales.size(), ", ", rounding_counts.size(), ", ", row_positions.size(), " and ",
                    column_positions.size(), " entries but momentum_buffers has ", count);
  check_momentum_lists("muon_momentum_rounded_", momentum_buffers, grads, updates, finite, beta);
  for (size_t i = 0; i < count; ++i) {
    check_rounded_item(momentum_buffers[i], scales.get(i), rounding_counts[i], row_positions.get(i),
                       column_positions.get(i), i, finite);
    check_tensor(grads[i], "grads", i, finite);
    check_tensor(updates[i], "updates", i, finite);
    for (const auto& [name, tensor] : {std::pair{"grads", grads[i]}, std::pair{"updates", updates[i]}}) {
      TORCH_CHECK_VALUE(tensor.sizes() == momentum_buffers[i].sizes(), "muon_momentum_rounded_: ", name, "[", i,
                        "] has shape ", tensor.sizes(), " but momentum_buffers[", i, "] has shape ",
                        momentum_buffers[i].sizes());
    }
  }
}

MomentCode moment_code(c10::string_view name) {
  if (name == "bfloat16") return MomentCode::kBFloat16;
  if (name == "linear") return MomentCode::kLinear;
  if (name == "e4m3") return MomentCode::kE4m3;
  TORCH_CHECK_VALUE(name == "e4m3_root", "moment code must be 'bfloat16', 'linear', 'e4m3' or 'e4m3_root', got '",
                    name, "'");
  return MomentCode::kE4m3Root;
}

// A stored moment of `sizes` on `device` and its scales (shared by load_moment_, store_moment_ and adamw_rounded_):
// `op` names the op for the messages.
void check_stored_form(const char* op, const at::Tensor& stored, const std::optional<at::Tensor>& scales,
                       c10::IntArrayRef sizes, c10::Device device, MomentCode code) {
  const bool quantized = code != MomentCode::kBFloat16;
  TORCH_CHECK_VALUE(stored.scalar_type() == (quantized ? at::kChar : at::kBFloat16), op, ": stored has dtype ",
                    stored.scalar_type(), " but its code needs ", quantized ? "int8" : "bfloat16");
  TORCH_CHECK_VALUE(stored.is_contiguous() && stored.device() == device && stored.sizes() == sizes, op,
                    ": stored must be contiguous, of shape ", sizes, " and on ", device, ", got shape ",
                    stored.sizes(), " on ", stored.device());
  TORCH_CHECK_VALUE(scales.has_value() == quantized, op, ": scales must be ",
                    quantized ? "given for int8 codes" : "None for a bfloat16 moment");
  if (quantized) {
    TORCH_CHECK_VALUE(stored.dim() >= 1, op, ": int8 codes need at least one dim, got a 0-dim tensor");
    std::vector<int64_t> expected(stored.sizes().begin(), stored.sizes().end());
    expected.back() = (expected.back() + kRoundedBlock - 1) / kRoundedBlock;
    TORCH_CHECK_VALUE(scales->scalar_type() == at::kFloat && scales->device() == device &&
                          scales->is_contiguous() && scales->sizes() == c10::IntArrayRef(expected),
                      op, ": scales must be a contiguous float32 tensor of shape ", c10::IntArrayRef(expected), " on ",
                      device, ", got ", scales->scalar_type(), " of shape ", scales->sizes(), " on ",
                      scales->device());
  }
}

// load_moment_'s and store_moment_'s: the stored form and the float32 values it is read into or written from.
void check_stored_moment(const char* op, const at::Tensor& stored, const std::optional<at::Tensor>& scales,
                         const at::Tensor& values, MomentCode code) {
  TORCH_CHECK_VALUE(values.scalar_type() == at::kFloat && values.is_contiguous() && values.sizes() == stored.sizes(),
                    op, ": the float32 values must be contiguous of shape ", stored.sizes(), ", got ",
                    values.scalar_type(), " of shape ", values.sizes());
  check_stored_form(op, stored, scales, values.sizes(), values.device(), code);
}

template <LoadMomentImpl impl>
void checked_load_moment(at::Tensor& out, const at::Tensor& stored, const std::optional<at::Tensor>& scales,
                         c10::string_view code_name) {
  const MomentCode code = moment_code(code_name);
  check_stored_moment("load_moment_", stored, scales, out, code);
  impl(out, stored, scales, code);
}

template <StoreMomentImpl impl>
void checked_store_moment(at::Tensor& stored, const std::optional<at::Tensor>& scales, const at::Tensor& values,
                          const at::Tensor& rounding_count, const std::optional<at::Tensor>& row_positions,
                          const std::optional<at::Tensor>& column_positions, int64_t position_offset,
                          const at::Tensor& taken, c10::string_view code_name) {
  const MomentCode code = moment_code(code_name);
  check_stored_moment("store_moment_", stored, scales, values, code);
  TORCH_CHECK_VALUE(rounding_count.scalar_type() == at::kLong && rounding_count.numel() == 1 &&
                        rounding_count.device() == values.device(),
                    "store_moment_: rounding_count must be one int64 on ", values.device(), ", got ",
                    rounding_count.scalar_type(), " of shape ", rounding_count.sizes());
  TORCH_CHECK_VALUE(taken.scalar_type() == at::kFloat && taken.numel() == 1 && taken.device() == values.device(),
                    "store_moment_: taken must be one float32 on ", values.device(), ", got ", taken.scalar_type(),
                    " of shape ", taken.sizes());
  TORCH_CHECK_VALUE(position_offset >= 0, "store_moment_: position_offset must be >= 0, got ", position_offset);
  check_positions("store_moment_", "", row_positions, column_positions, position_offset, stored.numel(),
                  values.device());
  impl(stored, scales, values, rounding_count, row_positions, column_positions, position_offset, taken, code);
}

// The tensors an op only reads, one result per tensor: contiguous, of a supported dtype, where the results are.
void check_read_tensors(const char* op, at::TensorList tensors, const at::Tensor& results) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK_VALUE(tensors[i].device() == results.device(), op, ": tensors[", i, "] is on ", tensors[i].device(),
                      " but the results are on ", results.device());
    TORCH_CHECK_VALUE(is_supported_dtype(tensors[i].scalar_type()), op, ": tensors[", i, "] has dtype ",
                      tensors[i].scalar_type(), " (expected float32, float64, bfloat16 or float16)");
    TORCH_CHECK_VALUE(tensors[i].is_contiguous(), op, ": tensors[", i, "] must be contiguous");
  }
}

// Shared by every backend: the flags are the tensors' own, one per tensor, written where the tensors are.
template <FiniteFlagsImpl impl>
void checked_finite_flags(at::TensorList tensors, const at::Tensor& finite) {
  check_flags("finite_flags_", finite, tensors.size());
  check_read_tensors("finite_flags_", tensors, finite);
  impl(tensors, finite);
}

template <SquaredNormsImpl impl>
void checked_squared_norms(at::TensorList tensors, const at::Tensor& sums) {
  TORCH_CHECK_VALUE(sums.scalar_type() == at::kDouble && sums.dim() == 1 && sums.is_contiguous() &&
                        sums.numel() == static_cast<int64_t>(tensors.size()),
                    "squared_norms_: sums must be a contiguous float64 tensor of shape (", tensors.size(), "), got ",
                    sums.scalar_type(), " of shape ", sums.sizes());
  check_read_tensors("squared_norms_", tensors, sums);
  impl(tensors, sums);
}

template <MuonMomentumImpl impl>
void checked_muon_momentum(at::TensorList momentum_buffers, at::TensorList grads, at::TensorList updates,
                           const at::Tensor& finite, double beta, bool nesterov) {
  check_muon_momentum_args(momentum_buffers, grads, updates, finite, beta);
  impl(momentum_buffers, grads, updates, finite, beta, nesterov);
}

template <MuonMomentumRoundedImpl impl>
void checked_muon_momentum_rounded(at::TensorList momentum_buffers, const OptionalTensors& scales,
                                   at::TensorList grads, at::TensorList updates, const at::Tensor& finite,
                                   at::TensorList rounding_counts, const OptionalTensors& row_positions,
                                   const OptionalTensors& column_positions, double beta, bool nesterov) {
  check_muon_momentum_rounded_args(momentum_buffers, scales, grads, updates, finite, rounding_counts, row_positions,
                                   column_positions, beta);
  impl(momentum_buffers, scales, grads, updates, finite, rounding_counts, row_positions, column_positions, beta,
       nesterov);
}

// The bytes [begin, end) a tensor's elements can occupy (a superset for gapped strides: a safe answer for overlap).
std::pair<uintptr_t, uintptr_t> memory_span(const at::Tensor& tensor) {
  const auto begin = reinterpret_cast<uintptr_t>(tensor.const_data_ptr());
  if (tensor.numel() == 0) {
    return {begin, begin};
  }
  int64_t last = 0;
  for (int64_t dim = 0; dim < tensor.dim(); ++dim) {
    last += (tensor.size(dim) - 1) * tensor.stride(dim);
  }
  return {begin, begin + static_cast<uintptr_t>((last + 1) * tensor.element_size())};
}

bool share_memory(const at::Tensor& first, const at::Tensor& second) {
  const auto [first_begin, first_end] = memory_span(first);
  const auto [second_begin, second_end] = memory_span(second);
  return first_begin < second_end && second_begin < first_end;
}

// out and C: (m, m), or (B, m, m) for a batched X (B, m, k), on X's device and in X's dtype.
void check_gram_operand(const at::Tensor& operand, const char* name, const at::Tensor& X) {
  TORCH_CHECK_VALUE(operand.device() == X.device(), "symmetric_gram_: ", name, " is on ", operand.device(),
                    " but X is on ", X.device());
  TORCH_CHECK_VALUE(operand.scalar_type() == X.scalar_type(), "symmetric_gram_: ", name, " has dtype ",
                    operand.scalar_type(), " but X has dtype ", X.scalar_type());
  std::vector<int64_t> expected(X.sizes().begin(), X.sizes().end());
  expected.back() = X.size(-2);
  TORCH_CHECK_VALUE(operand.sizes() == c10::IntArrayRef(expected), "symmetric_gram_: ", name, " has shape ",
                    operand.sizes(), " but X of shape ", X.sizes(), " needs ", c10::IntArrayRef(expected));
}

// Shared by every backend. X and C may have any strides; out must be contiguous. Inputs may share memory with each
// other (C is often X itself) but not with out, which is overwritten while they are read.
void check_symmetric_gram_args(const at::Tensor& out, const at::Tensor& X, const std::optional<at::Tensor>& C) {
  TORCH_CHECK_VALUE(X.dim() == 2 || X.dim() == 3, "symmetric_gram_: X must be (m, k) or (B, m, k), got shape ",
                    X.sizes());
  TORCH_CHECK_VALUE(is_supported_dtype(X.scalar_type()), "symmetric_gram_: X has dtype ", X.scalar_type(),
                    " (expected float32, float64, bfloat16 or float16)");
  check_gram_operand(out, "out", X);
  TORCH_CHECK_VALUE(out.is_contiguous(), "symmetric_gram_: out must be contiguous");
  TORCH_CHECK_VALUE(!share_memory(X, out), "symmetric_gram_: X shares memory with out");
  if (C.has_value()) {
    check_gram_operand(*C, "C", X);
    TORCH_CHECK_VALUE(!share_memory(*C, out), "symmetric_gram_: C shares memory with out");
  }
}

template <SymmetricGramImpl impl>
void checked_symmetric_gram(at::Tensor& out, const at::Tensor& X, const std::optional<at::Tensor>& C, double alpha,
                            double beta) {
  check_symmetric_gram_args(out, X, C);
  impl(out, X, C, alpha, beta);
}

// One float64 value per tensor of an op's list, read on the host.
void check_host_factors(const char* op, const char* name, const at::Tensor& tensor, int64_t count) {
  TORCH_CHECK_VALUE(tensor.scalar_type() == at::kDouble && tensor.dim() == 1 && tensor.numel() == count &&
                        tensor.is_contiguous() && tensor.is_cpu(),
                    op, ": ", name, " must be a contiguous float64 CPU tensor of shape (", count, "), got ",
                    tensor.scalar_type(), " of shape ", tensor.sizes(), " on ", tensor.device());
}

void check_apply_update_args(at::TensorList params, at::TensorList updates, const at::Tensor& decay,
                             const at::Tensor& step_sizes) {
  const auto count = static_cast<int64_t>(params.size());
  TORCH_CHECK_VALUE(updates.size() == params.size(), "apply_update_: updates has ", updates.size(),
                    " tensors but params has ", count);
  check_host_factors("apply_update_", "decay", decay, count);
  check_host_factors("apply_update_", "step_sizes", step_sizes, count);
  for (size_t i = 0; i < params.size(); ++i) {
    for (const auto& [name, tensor] : {std::pair{"params", params[i]}, std::pair{"updates", updates[i]}}) {
      TORCH_CHECK_VALUE(tensor.device() == params[0].device(), "apply_update_: ", name, "[", i, "] is on ",
                        tensor.device(), " but params[0] is on ", params[0].device());
      TORCH_CHECK_VALUE(is_supported_dtype(tensor.scalar_type()), "apply_update_: ", name, "[", i, "] has dtype ",
                        tensor.scalar_type(), " (expected float32, float64, bfloat16 or float16)");
    }
    TORCH_CHECK_VALUE(params[i].is_contiguous(), "apply_update_: params[", i, "] must be contiguous");
    TORCH_CHECK_VALUE(is_contiguous_or_transposed(updates[i]),
                      "apply_update_: updates[", i, "] must be contiguous or the transpose of a contiguous tensor "
                      "(its last two dims swapped)");
    TORCH_CHECK_VALUE(updates[i].sizes() == params[i].sizes(), "apply_update_: updates[", i, "] has shape ",
                      updates[i].sizes(), " but params[", i, "] has shape ", params[i].sizes());
    TORCH_CHECK_VALUE(!share_memory(params[i], updates[i]), "apply_update_: updates[", i, "] shares memory with params[",
                      i, "]");
  }
}

template <ApplyUpdateImpl impl>
void checked_apply_update(at::TensorList params, at::TensorList updates, const at::Tensor& decay,
                          const at::Tensor& step_sizes) {
  check_apply_update_args(params, updates, decay, step_sizes);
  impl(params, updates, decay, step_sizes);
}

// The rules both normalization ops share: one moment per update, a decay, a correction and a sum of squares per update
// on the host, one device, a supported update dtype, updates contiguous or stored transposed, float32 or float64
// contiguous moments that share no memory with their update.
void check_normalization_args(const char* op, at::TensorList updates, at::TensorList moments,
                              const at::Tensor& decays, const at::Tensor& corrections, const at::Tensor& squares) {
  const auto count = static_cast<int64_t>(updates.size());
  TORCH_CHECK_VALUE(moments.size() == updates.size(), op, ": moments has ", moments.size(), " tensors but updates has ",
                    count);
  check_host_factors(op, "decays", decays, count);
  check_host_factors(op, "corrections", corrections, count);
  check_host_factors(op, "squares", squares, count);
  for (size_t i = 0; i < updates.size(); ++i) {
    for (const auto& [name, tensor] : {std::pair{"updates", updates[i]}, std::pair{"moments", moments[i]}}) {
      TORCH_CHECK_VALUE(tensor.device() == updates[0].device(), op, ": ", name, "[", i, "] is on ", tensor.device(),
                        " but updates[0] is on ", updates[0].device());
    }
    TORCH_CHECK_VALUE(is_supported_dtype(updates[i].scalar_type()), op, ": updates[", i, "] has dtype ",
                      updates[i].scalar_type(), " (expected float32, float64, bfloat16 or float16)");
    TORCH_CHECK_VALUE(moments[i].scalar_type() == at::kFloat || moments[i].scalar_type() == at::kDouble, op,
                      ": moments[", i, "] has dtype ", moments[i].scalar_type(), " (expected float32 or float64)");
    TORCH_CHECK_VALUE(!share_memory(updates[i], moments[i]), op, ": moments[", i, "] shares memory with updates[", i,
                      "]");
    TORCH_CHECK_VALUE(is_contiguous_or_transposed(updates[i]), op, ": updates[", i,
                      "] must be contiguous or the transpose of a contiguous tensor (its last two dims swapped)");
    TORCH_CHECK_VALUE(moments[i].is_contiguous(), op, ": moments[", i, "] must be contiguous");
  }
}

void check_normalize_elements_args(at::TensorList updates, at::TensorList moments, const at::Tensor& decays,
                                   const at::Tensor& corrections, const at::Tensor& squares) {
  const char* op = "normalize_elements_";
  check_normalization_args(op, updates, moments, decays, corrections, squares);
  for (size_t i = 0; i < updates.size(); ++i) {
    TORCH_CHECK_VALUE(moments[i].sizes() == updates[i].sizes(), op, ": moments[", i, "] has shape ",
                      moments[i].sizes(), " but updates[", i, "] has shape ", updates[i].sizes());
  }
}

template <NormalizeElementsImpl impl>
void checked_normalize_elements(at::TensorList updates, at::TensorList moments, const at::Tensor& decays,
                                const at::Tensor& corrections, double one_minus_beta, double eps,
                                const at::Tensor& squares) {
  check_normalize_elements_args(updates, moments, decays, corrections, squares);
  impl(updates, moments, decays, corrections, one_minus_beta, eps, squares);
}

void check_normalize_rows_args(at::TensorList updates, at::TensorList moments, const at::Tensor& decays,
                               const at::Tensor& corrections, const at::Tensor& squares) {
  const char* op = "normalize_rows_";
  check_normalization_args(op, updates, moments, decays, corrections, squares);
  for (size_t i = 0; i < updates.size(); ++i) {
    TORCH_CHECK_VALUE(updates[i].dim() >= 2, op, ": updates[", i, "] must be (..., rows, cols), got shape ",
                      updates[i].sizes());
    const int64_t rows = updates[i].numel() / std::max<int64_t>(updates[i].size(-1), 1);
    TORCH_CHECK_VALUE(moments[i].numel() == rows, op, ": moments[", i, "] has ", moments[i].numel(),
                      " entries but updates[", i, "] of shape ", updates[i].sizes(), " has ", rows, " rows");
  }
}

template <NormalizeRowsImpl impl>
void checked_normalize_rows(at::TensorList updates, at::TensorList moments, const at::Tensor& decays,
                            const at::Tensor& corrections, double one_minus_beta, double eps,
                            const at::Tensor& squares) {
  check_normalize_rows_args(updates, moments, decays, corrections, squares);
  impl(updates, moments, decays, corrections, one_minus_beta, eps, squares);
}

void check_adamw_betas(const char* op, double beta1, double beta2) {
  for (const auto& [name, beta] : {std::pair{"beta1", beta1}, std::pair{"beta2", beta2}}) {
    TORCH_CHECK_VALUE(std::isfinite(beta) && beta >= 0.0 && beta < 1.0, op, ": ", name, " must be in [0, 1), got ",
                      beta);
  }
}

void check_adamw_rounded_args(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                              const std::optional<at::Tensor>& exp_avg_scales, const at::Tensor& exp_avg_sq,
                              const std::optional<at::Tensor>& exp_avg_sq_scales, const at::Tensor& rounding_count,
                              const std::optional<at::Tensor>& row_positions,
                              const std::optional<at::Tensor>& column_positions, const at::Tensor& step, double beta1,
                              double beta2) {
  const char* op = "adamw_rounded_";
  for (const auto& [name, tensor] : {std::pair{"param", param}, std::pair{"grad", grad}}) {
    TORCH_CHECK_VALUE(is_supported_dtype(tensor.scalar_type()), op, ": ", name, " has dtype ", tensor.scalar_type(),
                      " (expected float32, float64, bfloat16 or float16)");
    TORCH_CHECK_VALUE(tensor.is_contiguous() && tensor.sizes() == param.sizes() && tensor.device() == param.device(),
                      op, ": ", name, " must be contiguous, of shape ", param.sizes(), " and on ", param.device());
  }
  TORCH_CHECK_VALUE(exp_avg.scalar_type() == exp_avg_sq.scalar_type() &&
                        exp_avg_scales.has_value() == exp_avg_sq_scales.has_value(),
                    op, ": exp_avg and exp_avg_sq must be stored in the same form");
  const MomentCode code = exp_avg_scales.has_value() ? MomentCode::kE4m3 : MomentCode::kBFloat16;
  for (const auto& [stored, scales] : {std::pair{exp_avg, exp_avg_scales}, std::pair{exp_avg_sq, exp_avg_sq_scales}}) {
    check_stored_form(op, stored, scales, param.sizes(), param.device(), code);
  }
  TORCH_CHECK_VALUE(rounding_count.scalar_type() == at::kLong && rounding_count.numel() == 1 &&
                        rounding_count.device() == param.device(),
                    op, ": rounding_count must be one int64 on ", param.device());
  TORCH_CHECK_VALUE(step.scalar_type() == at::kFloat && step.numel() == 1 && step.device() == param.device(), op,
                    ": step must be one float32 on ", param.device(), ", got ", step.scalar_type(), " of shape ",
                    step.sizes());
  check_positions(op, "", row_positions, column_positions, 0, param.numel(), param.device());
  check_adamw_betas(op, beta1, beta2);
}

template <AdamWRoundedImpl impl>
void checked_adamw_rounded(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                           const std::optional<at::Tensor>& exp_avg_scales, at::Tensor& exp_avg_sq,
                           const std::optional<at::Tensor>& exp_avg_sq_scales, const at::Tensor& rounding_count,
                           const std::optional<at::Tensor>& row_positions,
                           const std::optional<at::Tensor>& column_positions, const at::Tensor& step, double lr,
                           double beta1, double beta2, double eps, double weight_decay) {
  check_adamw_rounded_args(param, grad, exp_avg, exp_avg_scales, exp_avg_sq, exp_avg_sq_scales, rounding_count,
                           row_positions, column_positions, step, beta1, beta2);
  impl(param, grad, exp_avg, exp_avg_scales, exp_avg_sq, exp_avg_sq_scales, rounding_count, row_positions,
       column_positions, step, lr, beta1, beta2, eps, weight_decay);
}

void check_adamw_checked_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                              at::TensorList exp_avg_sqs, at::TensorList steps, const at::Tensor& found_inf,
                              at::ArrayRef<double> lr, double beta1, double beta2, at::ArrayRef<double> weight_decay) {
  const char* op = "adamw_checked_";
  const size_t count = params.size();
  for (const auto& [name, list] : {std::pair{"grads", grads}, std::pair{"exp_avgs", exp_avgs},
                                   std::pair{"exp_avg_sqs", exp_avg_sqs}, std::pair{"steps", steps}}) {
    TORCH_CHECK_VALUE(list.size() == count, op, ": ", name, " has ", list.size(), " tensors but params has ", count);
  }
  for (const auto& [name, rates] : {std::pair{"lr", lr}, std::pair{"weight_decay", weight_decay}}) {
    TORCH_CHECK_VALUE(rates.size() == 1 || rates.size() == count, op, ": ", name, " has ", rates.size(),
                      " values (expected 1 for every parameter, or one per parameter: ", count, ")");
  }
  check_flags(op, found_inf, count, "found_inf");
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& param = params[i];
    TORCH_CHECK_VALUE(param.scalar_type() == at::kFloat || param.scalar_type() == at::kBFloat16, op, ": params[", i,
                      "] has dtype ", param.scalar_type(), " (expected float32 or bfloat16)");
    for (const auto& [name, tensor] : {std::pair{"params", param}, std::pair{"exp_avgs", exp_avgs[i]},
                                       std::pair{"exp_avg_sqs", exp_avg_sqs[i]}}) {
      TORCH_CHECK_VALUE(tensor.sizes() == param.sizes() && tensor.scalar_type() == param.scalar_type() &&
                            tensor.device() == found_inf.device(),
                        op, ": ", name, "[", i, "] must be of shape ", param.sizes(), ", dtype ", param.scalar_type(),
                        " and on ", found_inf.device(), ", got ", tensor.scalar_type(), " of shape ", tensor.sizes(),
                        " on ", tensor.device());
    }
    const at::Tensor& grad = grads[i];
    TORCH_CHECK_VALUE(grad.sizes() == param.sizes() && at::isFloatingType(grad.scalar_type()) &&
                          grad.device() == found_inf.device(),
                      op, ": grads[", i, "] must be a floating tensor of shape ", param.sizes(), " on ",
                      found_inf.device(), ", got ", grad.scalar_type(), " of shape ", grad.sizes(), " on ",
                      grad.device());
    TORCH_CHECK_VALUE(steps[i].scalar_type() == at::kFloat && steps[i].numel() == 1 &&
                          steps[i].device() == found_inf.device(),
                      op, ": steps[", i, "] must be one float32 on ", found_inf.device(), ", got ",
                      steps[i].scalar_type(), " of shape ", steps[i].sizes());
  }
  check_adamw_betas(op, beta1, beta2);
}

template <AdamWCheckedImpl impl>
void checked_adamw_checked(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList steps, const at::Tensor& found_inf, bool check,
                           at::ArrayRef<double> lr, double beta1, double beta2, double eps,
                           at::ArrayRef<double> weight_decay) {
  check_adamw_checked_args(params, grads, exp_avgs, exp_avg_sqs, steps, found_inf, lr, beta1, beta2, weight_decay);
  impl(params, grads, exp_avgs, exp_avg_sqs, steps, found_inf, check, lr, beta1, beta2, eps, weight_decay);
}

}  // namespace

TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  // Momentum buffers, updates and flags are written in place; the grads are only read.
  ops.def(
      "muon_momentum_(Tensor(a!)[] momentum_buffers, Tensor[] grads, Tensor(b!)[] updates, Tensor(c!) finite, "
      "float beta, bool nesterov) -> ()");
  // The same step on bfloat16 or int8-coded momentum (with block scales), stored back stochastically rounded.
  ops.def(
      "muon_momentum_rounded_(Tensor(a!)[] momentum_buffers, Tensor(b!)?[] scales, Tensor[] grads, "
      "Tensor(c!)[] updates, Tensor(d!) finite, Tensor[] rounding_counts, Tensor?[] row_positions, "
      "Tensor?[] column_positions, float beta, bool nesterov) -> ()");
  // out = alpha * X X^T + beta * C, written whole and exactly symmetric; C (symmetric) and beta are ignored when
  // C is None, and then out's old contents are never read.
  ops.def("symmetric_gram_(Tensor(a!) out, Tensor X, Tensor? C, float alpha, float beta) -> ()");
  // finite[i] = 1.0 where tensors[i] holds no NaN or Inf, else 0.0: the gradient check of AdamW-routed parameters.
  ops.def("finite_flags_(Tensor[] tensors, Tensor(a!) finite) -> ()");
  // sums[i] = the sum of squares of tensors[i], in float64: gradient clipping's norms and finite checks in one read.
  ops.def("squared_norms_(Tensor[] tensors, Tensor(a!) sums) -> ()");
  // out = the float32 values of a moment stored in fewer bytes (see torch_binding.h's MomentCode).
  ops.def("load_moment_(Tensor(a!) out, Tensor stored, Tensor? scales, str code) -> ()");
  // The moment <- values, rounded at random; untouched where taken is 0.
  ops.def(
      "store_moment_(Tensor(a!) stored, Tensor(b!)? scales, Tensor values, Tensor rounding_count, "
      "Tensor? row_positions, Tensor? column_positions, int position_offset, Tensor taken, str code) -> ()");
  // params[i] <- params[i] * decay[i] + step_sizes[i] * updates[i], rounded after the decay and after the add.
  ops.def("apply_update_(Tensor(a!)[] params, Tensor[] updates, Tensor decay, Tensor step_sizes) -> ()");
  // One AdamW step on moments stored in fewer bytes, read, stepped and stored back rounded in one pass.
  ops.def(
      "adamw_rounded_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!)? exp_avg_scales, "
      "Tensor(d!) exp_avg_sq, Tensor(e!)? exp_avg_sq_scales, Tensor rounding_count, Tensor? row_positions, "
      "Tensor? column_positions, Tensor step, float lr, float beta1, float beta2, float eps, "
      "float weight_decay) -> ()");
  // AdamW's step on moments stored as they are, each gradient checked first where `check` (see torch_binding.h);
  // lr and weight_decay one for every parameter or one per parameter (param groups sharing the call).
  ops.def(
      "adamw_checked_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] steps, Tensor(e!) found_inf, bool check, float[] lr, float beta1, float beta2, float eps, "
      "float[] weight_decay) -> ()");
  // AdaMuon's per-entry second moment and division, in place, with the result's sum of squares (see
  // torch_binding.h).
  ops.def(
      "normalize_elements_(Tensor(a!)[] updates, Tensor(b!)[] moments, Tensor decays, Tensor corrections, "
      "float one_minus_beta, float eps, Tensor(c!) squares) -> ()");
  // NorMuon's per-row second moment and division, in place, with the result's sum of squares (see torch_binding.h).
  ops.def(
      "normalize_rows_(Tensor(a!)[] updates, Tensor(b!)[] moments, Tensor decays, Tensor corrections, "
      "float one_minus_beta, float eps, Tensor(c!) squares) -> ()");
#if defined(CPU_KERNEL)
  ops.impl("apply_update_", c10::DeviceType::CPU, &checked_apply_update<&apply_update_cpu>);
  ops.impl("normalize_elements_", c10::DeviceType::CPU, &checked_normalize_elements<&normalize_elements_cpu>);
  ops.impl("normalize_rows_", c10::DeviceType::CPU, &checked_normalize_rows<&normalize_rows_cpu>);
  ops.impl("adamw_rounded_", c10::DeviceType::CPU, &checked_adamw_rounded<&adamw_rounded_cpu>);
  ops.impl("adamw_checked_", c10::DeviceType::CPU, &checked_adamw_checked<&adamw_checked_cpu>);
  ops.impl("muon_momentum_", c10::DeviceType::CPU, &checked_muon_momentum<&muon_momentum_cpu>);
  ops.impl("muon_momentum_rounded_", c10::DeviceType::CPU,
           &checked_muon_momentum_rounded<&muon_momentum_rounded_cpu>);
  ops.impl("symmetric_gram_", c10::DeviceType::CPU, &checked_symmetric_gram<&symmetric_gram_cpu>);
  ops.impl("finite_flags_", c10::DeviceType::CPU, &checked_finite_flags<&finite_flags_cpu>);
  ops.impl("squared_norms_", c10::DeviceType::CPU, &checked_squared_norms<&squared_norms_cpu>);
  ops.impl("load_moment_", c10::DeviceType::CPU, &checked_load_moment<&load_moment_cpu>);
  ops.impl("store_moment_", c10::DeviceType::CPU, &checked_store_moment<&store_moment_cpu>);
#endif
#if defined(CUDA_KERNEL)
  ops.impl("muon_momentum_", c10::DeviceType::CUDA, &checked_muon_momentum<&muon_momentum_cuda>);
  ops.impl("muon_momentum_rounded_", c10::DeviceType::CUDA,
           &checked_muon_momentum_rounded<&muon_momentum_rounded_cuda>);
  ops.impl("symmetric_gram_", c10::DeviceType::CUDA, &checked_symmetric_gram<&symmetric_gram_cuda>);
  ops.impl("load_moment_", c10::DeviceType::CUDA, &checked_load_moment<&load_moment_cuda>);
  ops.impl("store_moment_", c10::DeviceType::CUDA, &checked_store_moment<&store_moment_cuda>);
#endif
}

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
