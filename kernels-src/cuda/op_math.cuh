#pragma once

namespace muon_cuda {

// torch's rule for arithmetic: float for float and the 16-bit types, double for double.
template <typename T>
struct OpMathOf {
  using type = float;
};
template <>
struct OpMathOf<double> {
  using type = double;
};
template <typename T>
using OpMath = typename OpMathOf<T>::type;

}  // namespace muon_cuda
