#pragma once
// torch's dtype as a launcher's DType: the one conversion every torch-facing binding file uses.
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "dtype.h"

namespace muon_cuda {

// `what` names the op and argument for the error, e.g. "symmetric_gram_: X".
inline DType launch_dtype(c10::ScalarType dtype, const char* what) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return DType::kFloat32;
    case c10::ScalarType::Double:
      return DType::kFloat64;
    case c10::ScalarType::BFloat16:
      return DType::kBFloat16;
    case c10::ScalarType::Half:
      return DType::kFloat16;
    default:
      TORCH_CHECK_VALUE(false, what, " has dtype ", dtype, " (expected float32, float64, bfloat16 or float16)");
  }
}

}  // namespace muon_cuda
