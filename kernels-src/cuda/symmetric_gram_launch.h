#pragma once
// Launcher for the kernels in symmetric_gram.cu. Raw pointers and a stream only: no torch headers, so the .cu
// compiles in seconds and the torch-facing code stays in symmetric_gram_cuda.cpp.
#include <cstdint>

#include <cuda_runtime_api.h>

#include "dtype.h"

namespace muon_cuda {

// Where the matrices of a batch live: element (b, i, j) is at data[b * batch_stride + i * row_stride + j].
struct MatrixLayout {
  int64_t batch_stride;
  int64_t row_stride;
};

// out[b] = alpha * x[b] @ x[b]^T + beta * c[b] for every b < batch, with x[b] of shape (rows, depth) and out[b],
// c[b] of shape (rows, rows), all of one dtype; products and sums in fp32 (fp64 for fp64), one rounding on the store.
// Only lower tiles are computed; each is stored at its own place and transposed at its mirror, so out is exactly
// symmetric. c (nullptr when absent, and then beta is unused) is read on and below the diagonal only, each element
// just before out's element at the same place is written: c may be out itself, but must not partly overlap it.
// beta == 0 drops the c term, as torch's addmm does, so NaN or Inf in c never reach out. capability_major is the
// current device's: bf16 needs 8 or more (the caller checks), and cp.async copies are used from 8 on.
void launch_symmetric_gram(void* out, MatrixLayout out_layout, const void* x, MatrixLayout x_layout, const void* c,
                           MatrixLayout c_layout, DType dtype, int64_t batch, int64_t rows, int64_t depth,
                           double alpha, double beta, int capability_major, cudaStream_t stream);

}  // namespace muon_cuda
