// A moment kept in fewer bytes, read into and written from float32 on the CPU (`load_moment_`, `store_moment_`):
// per entry for bfloat16, per block of codes sharing one scale otherwise (the block's largest magnitude sets it).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/bit_cast.h>

#include "../common/stochastic_rounding.h"
#include "finite_cpu.h"
#include "moment_codes_cpu.h"
#include "torch_binding.h"

namespace {

using muon_cpu::Blocks;
using muon_cpu::Salt;

using muon_cpu::CodeValues;

MUON_VECTOR_CLONES void load_bfloat16(float* __restrict__ out, const uint16_t* __restrict__ stored, int64_t begin,
                                      int64_t end) {
  for (int64_t j = begin; j < end; ++j) {
    out[j] = c10::bit_cast<float>(static_cast<uint32_t>(stored[j]) << 16);
  }
}

MUON_VECTOR_CLONES void load_block(float* __restrict__ out, const uint8_t* __restrict__ codes, float scale,
                                   int64_t first, int64_t length, const CodeValues& values, bool squared) {
  for (int64_t j = first; j < first + length; ++j) {
    const float value = values.of[codes[j]] * scale;
    out[j] = squared ? value * value : value;
  }
}

MUON_VECTOR_CLONES void store_bfloat16(uint16_t* __restrict__ stored, const float* __restrict__ values,
                                       int64_t begin, int64_t end, const Salt& salt) {
  uint32_t bits[kRoundedBlock];
  for (int64_t first = begin; first < end; first += kRoundedBlock) {
    const int64_t length = std::min(kRoundedBlock, end - first);
    salt.fill(bits, first, length);
    for (int64_t t = 0; t < length; ++t) {
      stored[first + t] = muon_rounding::bfloat16_bits_rounded(values[first + t], bits[t]);
    }
  }
}

MUON_VECTOR_CLONES void store_blocks(int8_t* codes, float* scales, const float* values, int64_t begin, int64_t end,
                                     const Blocks& blocks, MomentCode code, const Salt& salt) {
  float coded[kRoundedBlock];
  for (int64_t block = begin; block < end; ++block) {
    const int64_t first = blocks.first(block), length = blocks.length(block);
    if (code == MomentCode::kE4m3Root) {
      for (int64_t t = 0; t < length; ++t) {
        coded[t] = std::sqrt(values[first + t]);
      }
    } else {
      std::copy(values + first, values + first + length, coded);
    }
    muon_cpu::store_block(codes, scales + block, coded, first, length, code, salt);
  }
}

}  // namespace

void load_moment_cpu(at::Tensor& out, const at::Tensor& stored, const std::optional<at::Tensor>& scales,
                     MomentCode code) {
  float* values = out.mutable_data_ptr<float>();
  if (code == MomentCode::kBFloat16) {
    const auto* bits = reinterpret_cast<const uint16_t*>(stored.const_data_ptr<at::BFloat16>());
    at::parallel_for(0, stored.numel(), muon_cpu::kGrainSize,
                     [&](int64_t begin, int64_t end) { load_bfloat16(values, bits, begin, end); });
    return;
  }
  const Blocks blocks(stored, *scales);
  static const CodeValues linear(MomentCode::kLinear), e4m3(MomentCode::kE4m3);
  const CodeValues& code_values = code == MomentCode::kLinear ? linear : e4m3;
  const auto* codes = reinterpret_cast<const uint8_t*>(stored.const_data_ptr<int8_t>());
  const float* block_scales = scales->const_data_ptr<float>();
  at::parallel_for(0, scales->numel(), muon_cpu::kGrainSize / kRoundedBlock, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      load_block(values, codes, block_scales[block], blocks.first(block), blocks.length(block), code_values,
                 code == MomentCode::kE4m3Root);
    }
  });
}

void store_moment_cpu(at::Tensor& stored, const std::optional<at::Tensor>& scales, const at::Tensor& values,
                      const at::Tensor& rounding_count, const std::optional<at::Tensor>& row_positions,
                      const std::optional<at::Tensor>& column_positions, int64_t position_offset,
                      const at::Tensor& taken, MomentCode code) {
  if (*taken.const_data_ptr<float>() == 0.0f) {
    return;
  }
  const Salt salt{*rounding_count.const_data_ptr<int64_t>(),
                  muon_rounding::entry_positions(row_positions, column_positions, position_offset)};
  const float* source = values.const_data_ptr<float>();
  if (code == MomentCode::kBFloat16) {
    auto* bits = reinterpret_cast<uint16_t*>(stored.mutable_data_ptr<at::BFloat16>());
    at::parallel_for(0, stored.numel(), muon_cpu::kGrainSize,
                     [&](int64_t begin, int64_t end) { store_bfloat16(bits, source, begin, end, salt); });
    return;
  }
  const Blocks blocks(stored, *scales);
  auto* codes = stored.mutable_data_ptr<int8_t>();
  float* block_scales = scales->mutable_data_ptr<float>();
  at::parallel_for(0, scales->numel(), muon_cpu::kGrainSize / kRoundedBlock, [&](int64_t begin, int64_t end) {
    store_blocks(codes, block_scales, source, begin, end, blocks, code, salt);
  });
}
