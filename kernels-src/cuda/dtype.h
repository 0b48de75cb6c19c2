#pragma once
// The element types the CUDA launchers take, shared by every kernel file. No torch headers: the .cu files include it.

namespace muon_cuda {

enum class DType { kFloat32, kFloat64, kBFloat16, kFloat16 };

}  // namespace muon_cuda
