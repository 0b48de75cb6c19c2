// out = alpha * X @ X^T + beta * C for the Newton-Schulz steps of Muon, computing only the lower tiles of the
// symmetric result and storing each one twice: at its place and transposed at its mirror. That halves the work of
// a Gram product. The idea is the one behind flash-muon's matmul_transpose kernel and modded-nanogpt's XXT Triton
// kernel; this is an independent CUDA implementation of it.
//
// Two kernels, one per math line:
//   bf16 / fp16:  tensor cores (WMMA 16x16x16, fp32 accumulators), 128 x 128 CTA tiles, K slices of 32 staged
//                 through shared memory, double-buffered with cp.async where the rows are 16-byte aligned and the
//                 GPU has it (sm_80+; on sm_75 fp16 only, with plain copies).
//   fp32 / fp64:  CUDA-core FMA in the input's own precision (no TF32) on 64 x 64 CTA tiles, 4 x 4 outputs per thread.
// Both share the tile walk (lower_tile_coords) and the epilogue (store_lower_and_mirror).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "op_math.cuh"
#include <mma.h>

#include "symmetric_gram_launch.h"

namespace muon_cuda {
namespace {


template <typename T>
struct GramArgs {
  T* out;
  const T* x;
  const T* c;  // nullptr: no beta * C term
  MatrixLayout out_layout;
  MatrixLayout x_layout;
  MatrixLayout c_layout;
  int64_t batch;
  int64_t rows;
  int64_t depth;
  OpMath<T> alpha;
  OpMath<T> beta;
};

// --- elements --------------------------------------------------------------------------------------------------------

__device__ __forceinline__ float to_op_math(float v) { return v; }
__device__ __forceinline__ double to_op_math(double v) { return v; }
__device__ __forceinline__ float to_op_math(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_op_math(__half v) { return __half2float(v); }

// Round to nearest even, as torch rounds fp32 results into 16-bit outputs.
template <typename T>
__device__ __forceinline__ T from_op_math(OpMath<T> v);
template <>
__device__ __forceinline__ float from_op_math<float>(float v) { return v; }
template <>
__device__ __forceinline__ double from_op_math<double>(double v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_op_math<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_op_math<__half>(float v) { return __float2half_rn(v); }

// --- which tile a CTA owns -------------------------------------------------------------------------------------------

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

__host__ __device__ constexpr int64_t lower_tile_count(int64_t tiles_per_side) {
  return tiles_per_side * (tiles_per_side + 1) / 2;
}

struct TileCoords {
  int64_t row;
  int64_t col;  // <= row
};

// The index-th tile of the lower triangle in row-major order. Row r starts at index r(r+1)/2; inverting that with
// the quadratic formula gives a guess that double rounding may leave one off, so the loops step to the exact row
// (each runs at most once). int64 throughout: the count of lower tiles can pass 2^31 for very large matrices.
// Host-callable too, so tests/test_cuda_compile.py can check it on machines without a GPU.
__host__ __device__ TileCoords lower_tile_coords(int64_t index) {
  int64_t row = static_cast<int64_t>((sqrt(8.0 * static_cast<double>(index) + 1.0) - 1.0) * 0.5);
  while (row * (row + 1) / 2 > index) {
    --row;
  }
  while ((row + 1) * (row + 2) / 2 <= index) {
    ++row;
  }
  return {row, index - row * (row + 1) / 2};
}

// Grids are capped at the hardware's limits; the kernels stride over whatever lies beyond (batches in y, tiles in
// x), so any size is covered.
dim3 gram_grid(int64_t rows, int64_t batch, int tile) {
  constexpr int64_t kMaxGridX = 2147483647;
  constexpr int64_t kMaxGridY = 65535;
  return dim3(static_cast<unsigned int>(std::min(lower_tile_count(ceil_div(rows, tile)), kMaxGridX)),
              static_cast<unsigned int>(std::min(batch, kMaxGridY)));
}

// --- the shared epilogue ---------------------------------------------------------------------------------------------

// Finishes a kRows x kCols block of out[batch_index] whose top-left element is (row0, col0), from the products
// (in OpMath<T>) in `stage` (leading dimension kLd). The block lies in a lower tile, so only its elements on or
// below the diagonal are taken (off the diagonal tiles, that is all of them).
// Pass 1, row by row (coalesced in out): value = alpha * product + beta * c, stored at its place and kept in stage.
// Pass 2, column by column (coalesced in the mirror): the values strictly below the diagonal, stored transposed.
// Both stores round the same value, so out is symmetric bit for bit. c is read only where pass 1 then writes
// out, by the same thread, which is what makes c == out safe.
template <typename T, int kRows, int kCols, int kLd, int kThreads>
__device__ void store_lower_and_mirror(OpMath<T>* stage, const GramArgs<T>& args, int64_t batch_index, int64_t row0,
                                       int64_t col0) {
  T* out = args.out + batch_index * args.out_layout.batch_stride;
  const T* c = args.c == nullptr ? nullptr : args.c + batch_index * args.c_layout.batch_stride;
  for (int i = threadIdx.x; i < kRows * kCols; i += kThreads) {
    const int r = i / kCols;
    const int col = i % kCols;
    const int64_t out_row = row0 + r;
    const int64_t out_col = col0 + col;
    if (out_row < args.rows && out_col <= out_row) {
      OpMath<T> value = args.alpha * stage[r * kLd + col];
      if (c != nullptr) {
        value += args.beta * to_op_math(c[out_row * args.c_layout.row_stride + out_col]);
      }
      stage[r * kLd + col] = value;
      out[out_row * args.out_layout.row_stride + out_col] = from_op_math<T>(value);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kRows * kCols; i += kThreads) {
    const int col = i / kRows;
    const int r = i % kRows;
    const int64_t out_row = row0 + r;
    const int64_t out_col = col0 + col;
    if (out_row < args.rows && out_col < out_row) {
      out[out_col * args.out_layout.row_stride + out_row] = from_op_math<T>(stage[r * kLd + col]);
    }
  }
  __syncthreads();  // stage (shared memory) is free again
}

// --- bf16 / fp16: tensor cores ---------------------------------------------------------------------------------------

namespace tensor_core {

constexpr int kTile = 128;       // CTA tile: 128 x 128 outputs
constexpr int kDepthStep = 32;   // K slice per pipeline stage (two 16-deep WMMA steps)
constexpr int kStages = 2;       // double buffering: copy slice s + 1 while multiplying slice s
constexpr int kSliceLd = kDepthStep + 8;  // +16 bytes: the 8 rows one fragment-load phase reads hit distinct banks
constexpr int kWarpsM = 2;
constexpr int kWarpsN = 4;
constexpr int kThreads = 32 * kWarpsM * kWarpsN;
constexpr int kWarpRows = kTile / kWarpsM;  // each warp owns a 64 x 32 block: 4 x 2 fragments
constexpr int kWarpCols = kTile / kWarpsN;
constexpr int kFrag = 16;
constexpr int kFragsM = kWarpRows / kFrag;
constexpr int kFragsN = kWarpCols / kFrag;
constexpr int kStageLd = kTile + 4;  // fp32 epilogue rows; WMMA stores want a multiple of 4 floats

// Shared memory, reused: the operand slices during the K loop, then one fp32 half tile (kWarpRows rows) at a time
// for the epilogue, which keeps the total under the 48 KiB a kernel gets without opting in.
constexpr int kElementBytes = 2;  // bf16 and fp16 only
constexpr int kSliceElements = kTile * kSliceLd;
constexpr int kOperandBytes = kStages * 2 * kSliceElements * kElementBytes;
constexpr int kEpilogueBytes = kWarpRows * kStageLd * static_cast<int>(sizeof(float));
constexpr int kSharedBytes = std::max(kOperandBytes, kEpilogueBytes);
static_assert(kSharedBytes <= 48 * 1024, "static shared memory is limited to 48 KiB");

using Accumulator = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, kFrag, kFrag, kFrag, float>;

// cp.async (sm80+): 16 bytes from global to shared memory without a trip through registers. With src_bytes = 0
// nothing is read and the 16 bytes are zero-filled: how rows past the matrix get their zeros.
__device__ __forceinline__ void copy_16_bytes_async(void* shared, const void* global, bool inside) {
  const auto shared_address = static_cast<unsigned int>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address), "l"(global),
               "r"(inside ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void commit_async_copies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most kPending of the most recently committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void wait_async_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Columns [k0, k0 + kDepthStep) of rows [row0, row0 + kTile) of x into `slice` (kTile x kSliceLd), zeros outside x.
// kAsync needs every row start 16-byte aligned and depth % 8 == 0, so that each 8-element copy lies wholly inside
// or wholly outside x; other inputs take the element-by-element path.
template <typename T, bool kAsync>
__device__ void load_slice(T* slice, const T* x, int64_t row_stride, int64_t rows, int64_t depth, int64_t row0,
                           int64_t k0) {
  if constexpr (kAsync) {
    constexpr int kPerCopy = 16 / sizeof(T);
    constexpr int kCopiesPerRow = kDepthStep / kPerCopy;
    for (int i = threadIdx.x; i < kTile * kCopiesPerRow; i += kThreads) {
      const int r = i / kCopiesPerRow;
      const int kk = i % kCopiesPerRow * kPerCopy;
      const bool inside = row0 + r < rows && k0 + kk < depth;
      // An outside copy reads nothing, but still gets an address that is valid and aligned.
      const T* source = inside ? x + (row0 + r) * row_stride + k0 + kk : x;
      copy_16_bytes_async(slice + r * kSliceLd + kk, source, inside);
    }
  } else {
    for (int i = threadIdx.x; i < kTile * kDepthStep; i += kThreads) {
      const int r = i / kDepthStep;
      const int kk = i % kDepthStep;
      const bool inside = row0 + r < rows && k0 + kk < depth;
      slice[r * kSliceLd + kk] = inside ? x[(row0 + r) * row_stride + k0 + kk] : from_op_math<T>(0.0f);
    }
  }
}

// acc += the warp's block of left @ right^T over one K slice. Both slices are row blocks of X (kTile x kDepthStep,
// row-major); right read column-major is exactly the matching slice of X^T, so no transposed copy is needed.
template <typename T>
__device__ void multiply_slice(Accumulator (&acc)[kFragsM][kFragsN], const T* left, const T* right, int warp_row,
                               int warp_col) {
  namespace wmma = nvcuda::wmma;
#pragma unroll
  for (int kk = 0; kk < kDepthStep; kk += kFrag) {
    wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, T, wmma::row_major> a[kFragsM];
    wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, T, wmma::col_major> b[kFragsN];
#pragma unroll
    for (int i = 0; i < kFragsM; ++i) {
      wmma::load_matrix_sync(a[i], left + (warp_row * kWarpRows + i * kFrag) * kSliceLd + kk, kSliceLd);
    }
#pragma unroll
    for (int j = 0; j < kFragsN; ++j) {
      wmma::load_matrix_sync(b[j], right + (warp_col * kWarpCols + j * kFrag) * kSliceLd + kk, kSliceLd);
    }
#pragma unroll
    for (int i = 0; i < kFragsM; ++i) {
#pragma unroll
      for (int j = 0; j < kFragsN; ++j) {
        wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
      }
    }
  }
}

template <typename T, bool kAsync>
__device__ void gram_tiles(const GramArgs<T>& args) {
  static_assert(sizeof(T) == kElementBytes, "the shared memory plan is for 16-bit inputs");
  namespace wmma = nvcuda::wmma;
  __shared__ __align__(128) unsigned char shared[kSharedBytes];
  T* slices = reinterpret_cast<T*>(shared);  // [stage][left, right][kTile][kSliceLd]
  float* stage_out = reinterpret_cast<float*>(shared);
  const auto left_slice = [&](int64_t step) { return slices + (step % kStages) * 2 * kSliceElements; };
  const auto right_slice = [&](int64_t step) { return left_slice(step) + kSliceElements; };

  const int warp = threadIdx.x / 32;
  const int warp_row = warp / kWarpsN;
  const int warp_col = warp % kWarpsN;
  const int64_t tiles = lower_tile_count(ceil_div(args.rows, kTile));
  const int64_t steps = ceil_div(args.depth, kDepthStep);

  for (int64_t b = blockIdx.y; b < args.batch; b += gridDim.y) {
    const T* x = args.x + b * args.x_layout.batch_stride;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      const TileCoords tile = lower_tile_coords(t);
      const int64_t row0 = tile.row * kTile;
      const int64_t col0 = tile.col * kTile;
      const auto load_step = [&](int64_t step) {
        const int64_t k0 = step * kDepthStep;
        load_slice<T, kAsync>(left_slice(step), x, args.x_layout.row_stride, args.rows, args.depth, row0, k0);
        load_slice<T, kAsync>(right_slice(step), x, args.x_layout.row_stride, args.rows, args.depth, col0, k0);
      };

      Accumulator acc[kFragsM][kFragsN];
#pragma unroll
      for (int i = 0; i < kFragsM; ++i) {
#pragma unroll
        for (int j = 0; j < kFragsN; ++j) {
          wmma::fill_fragment(acc[i][j], 0.0f);
        }
      }

      if (steps > 0) {
        load_step(0);
      }
      if constexpr (kAsync) {
        commit_async_copies();
      }
      for (int64_t step = 0; step < steps; ++step) {
        if (step + 1 < steps) {
          load_step(step + 1);
        }
        if constexpr (kAsync) {
          commit_async_copies();  // possibly empty, so that "all but the newest group" always means this step's
          wait_async_copies<1>();
        }
        __syncthreads();
        multiply_slice(acc, left_slice(step), right_slice(step), warp_row, warp_col);
        __syncthreads();  // the next iteration's copies overwrite this buffer
      }

      // One half tile at a time through stage_out: the warps owning those rows park their fragments there.
      for (int half = 0; half < kWarpsM && row0 + half * kWarpRows < args.rows; ++half) {
        if (warp_row == half) {
#pragma unroll
          for (int i = 0; i < kFragsM; ++i) {
#pragma unroll
            for (int j = 0; j < kFragsN; ++j) {
              wmma::store_matrix_sync(stage_out + i * kFrag * kStageLd + warp_col * kWarpCols + j * kFrag, acc[i][j],
                                      kStageLd, wmma::mem_row_major);
            }
          }
        }
        __syncthreads();
        store_lower_and_mirror<T, kWarpRows, kTile, kStageLd, kThreads>(stage_out, args, b, row0 + half * kWarpRows,
                                                                        col0);
      }
    }
  }
}

// bf16 WMMA fragments and cp.async exist from sm_80 on. The fatbinary also carries code for sm_75 (T4), where only
// the fp16 kernel with plain copies is compiled; launch() never starts the others there, and the op refuses bf16 on
// such a GPU before it gets here (symmetric_gram_cuda.cpp).
template <typename T, bool kAsync>
constexpr bool kNeedsSm80 = kAsync || std::is_same_v<T, __nv_bfloat16>;

template <typename T, bool kAsync>
__global__ void __launch_bounds__(kThreads) gram_kernel(GramArgs<T> args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  if constexpr (kNeedsSm80<T, kAsync>) {
    __trap();
  } else {
    gram_tiles<T, kAsync>(args);
  }
#else
  gram_tiles<T, kAsync>(args);
#endif
}

bool is_16_byte_aligned(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

template <typename T>
void launch(const GramArgs<T>& args, int capability_major, cudaStream_t stream) {
  constexpr int64_t kPerCopy = 16 / sizeof(T);
  const bool aligned_rows = is_16_byte_aligned(args.x) && args.x_layout.row_stride % kPerCopy == 0 &&
                            args.x_layout.batch_stride % kPerCopy == 0 && args.depth % kPerCopy == 0;
  const bool async_copies = aligned_rows && capability_major >= 8;
  const auto kernel = async_copies ? gram_kernel<T, true> : gram_kernel<T, false>;
  kernel<<<gram_grid(args.rows, args.batch, kTile), kThreads, 0, stream>>>(args);
}

}  // namespace tensor_core

// --- fp32 / fp64: CUDA-core FMA --------------------------------------------------------------------------------------

namespace cuda_core {

constexpr int kTile = 64;                            // CTA tile: 64 x 64 outputs
constexpr int kDepthStep = 16;                       // K slice per step
constexpr int kThreadsPerSide = 16;                  // 16 x 16 threads ...
constexpr int kPerThread = kTile / kThreadsPerSide;  // ... of 4 x 4 outputs each
constexpr int kThreads = kThreadsPerSide * kThreadsPerSide;
constexpr int kSliceLd = kTile + 4;  // slices are stored k-major; the padding spreads the transposing stores
constexpr int kStageLd = kTile + 1;  // odd, so the column-wise reads of the epilogue's mirror pass hit distinct banks

// Shared memory, reused: two K slices during the K loop, then the finished tile for the epilogue. For fp64 the two
// together would pass the 48 KiB a kernel gets without opting in.
template <typename T>
struct SharedBytes {
  static constexpr int kSlices = 2 * kDepthStep * kSliceLd * static_cast<int>(sizeof(T));
  static constexpr int kStage = kTile * kStageLd * static_cast<int>(sizeof(T));
  static constexpr int value = std::max(kSlices, kStage);
  static_assert(value <= 48 * 1024, "static shared memory is limited to 48 KiB");
};

// Columns [k0, k0 + kDepthStep) of rows [row0, row0 + kTile) of x, transposed into slice[k * kSliceLd + row], zeros
// outside x. Reads run along x's rows, so they coalesce.
template <typename T>
__device__ void load_transposed_slice(T* slice, const T* x, int64_t row_stride, int64_t rows, int64_t depth,
                                      int64_t row0, int64_t k0) {
  for (int i = threadIdx.x; i < kTile * kDepthStep; i += kThreads) {
    const int r = i / kDepthStep;
    const int kk = i % kDepthStep;
    const bool inside = row0 + r < rows && k0 + kk < depth;
    slice[kk * kSliceLd + r] = inside ? x[(row0 + r) * row_stride + k0 + kk] : T(0);
  }
}

// T is float or double, and the products are summed in T: the IEEE arithmetic of torch's own fp32 / fp64 matmul
// (with TF32 off), up to the order of the sums.
template <typename T>
__global__ void __launch_bounds__(kThreads) gram_kernel(GramArgs<T> args) {
  __shared__ __align__(16) unsigned char shared[SharedBytes<T>::value];
  T* left = reinterpret_cast<T*>(shared);
  T* right = left + kDepthStep * kSliceLd;
  T* stage_out = reinterpret_cast<T*>(shared);

  // A thread's outputs are strided by kThreadsPerSide, so a warp's reads of `right` are consecutive (no bank
  // conflicts) and its reads of `left` are broadcasts.
  const int thread_row = threadIdx.x / kThreadsPerSide;
  const int thread_col = threadIdx.x % kThreadsPerSide;
  const int64_t tiles = lower_tile_count(ceil_div(args.rows, kTile));

  for (int64_t b = blockIdx.y; b < args.batch; b += gridDim.y) {
    const T* x = args.x + b * args.x_layout.batch_stride;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      const TileCoords tile = lower_tile_coords(t);
      const int64_t row0 = tile.row * kTile;
      const int64_t col0 = tile.col * kTile;
      T acc[kPerThread][kPerThread] = {};
      for (int64_t k0 = 0; k0 < args.depth; k0 += kDepthStep) {
        load_transposed_slice(left, x, args.x_layout.row_stride, args.rows, args.depth, row0, k0);
        load_transposed_slice(right, x, args.x_layout.row_stride, args.rows, args.depth, col0, k0);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kDepthStep; ++kk) {
#pragma unroll
          for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
            for (int j = 0; j < kPerThread; ++j) {
              acc[i][j] = fma(left[kk * kSliceLd + thread_row + i * kThreadsPerSide],
                              right[kk * kSliceLd + thread_col + j * kThreadsPerSide], acc[i][j]);
            }
          }
        }
        __syncthreads();  // the next slice, or the epilogue, overwrites left and right
      }
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) {
          stage_out[(thread_row + i * kThreadsPerSide) * kStageLd + thread_col + j * kThreadsPerSide] = acc[i][j];
        }
      }
      __syncthreads();
      store_lower_and_mirror<T, kTile, kTile, kStageLd, kThreads>(stage_out, args, b, row0, col0);
    }
  }
}

template <typename T>
void launch(const GramArgs<T>& args, cudaStream_t stream) {
  gram_kernel<T><<<gram_grid(args.rows, args.batch, kTile), kThreads, 0, stream>>>(args);
}

}  // namespace cuda_core

template <typename T>
GramArgs<T> gram_args(void* out, MatrixLayout out_layout, const void* x, MatrixLayout x_layout, const void* c,
                      MatrixLayout c_layout, int64_t batch, int64_t rows, int64_t depth, double alpha, double beta) {
  return {static_cast<T*>(out), static_cast<const T*>(x), static_cast<const T*>(c), out_layout, x_layout, c_layout,
          batch, rows, depth, static_cast<OpMath<T>>(alpha), static_cast<OpMath<T>>(beta)};
}

}  // namespace

void launch_symmetric_gram(void* out, MatrixLayout out_layout, const void* x, MatrixLayout x_layout, const void* c,
                           MatrixLayout c_layout, DType dtype, int64_t batch, int64_t rows, int64_t depth,
                           double alpha, double beta, int capability_major, cudaStream_t stream) {
  if (batch == 0 || rows == 0) {
    return;
  }
  // As torch's addmm: beta = 0 drops the C term altogether, so NaN or Inf in C do not reach out.
  const void* c_term = beta == 0.0 ? nullptr : c;
  switch (dtype) {
    case DType::kFloat32:
      return cuda_core::launch(
          gram_args<float>(out, out_layout, x, x_layout, c_term, c_layout, batch, rows, depth, alpha, beta), stream);
    case DType::kFloat64:
      return cuda_core::launch(
          gram_args<double>(out, out_layout, x, x_layout, c_term, c_layout, batch, rows, depth, alpha, beta), stream);
    case DType::kBFloat16:
      return tensor_core::launch(gram_args<__nv_bfloat16>(out, out_layout, x, x_layout, c_term, c_layout, batch, rows,
                                                          depth, alpha, beta),
                                 capability_major, stream);
    case DType::kFloat16:
      return tensor_core::launch(
          gram_args<__half>(out, out_layout, x, x_layout, c_term, c_layout, batch, rows, depth, alpha, beta),
          capability_major, stream);
  }
}

}  // namespace muon_cuda
