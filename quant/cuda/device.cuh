#pragma once
// What the CUDA quantizer kernels share (included by quant/cuda/*.cu only):
// stream-ordered scratch, the engine's cuBLAS handle, a typed GEMM, warp
// reductions, and rounding to a dequantized dtype with the CPU's rules.
// Every quanta kernel runs on the device's default stream (see
// engine/cuda/caching_allocator.h), and so do these.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "engine/cuda/blas_handle.h"
#include "engine/cuda/check.cuh"
#include "engine/cuda/device_types.cuh"
#include "engine/cuda/launch.h"
#include "engine/cuda/scratch.h"
#include "engine/dtype.h"
#include "quant/cuda/plans.h"

namespace quanta::quant::quant_cuda {

/** Temporary device memory: the engine's, on the engine's stream
 * (engine/cuda/stream.h), where every quantizer kernel, copy and GEMM is
 * queued too. */
using quanta::cuda::Scratch;

/** The engine's cuBLAS handle of the current device (engine/cuda/blas_handle.h):
 * one per device for every product, so a capture makes it before it starts. */
using quanta::cuda::blas_handle;

/** Column-major C [m, n] = op(A) op(B) + beta C with bf16 A and B and f32 C:
 * f32 sums on the tensor cores (products of bf16 values are exact in f32). */
inline void gemm_bf16(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k,
                      const __nv_bfloat16* a, int64_t lda, const __nv_bfloat16* b, int64_t ldb,
                      float beta, float* c, int64_t ldc) {
  const float alpha = 1.0f;
  QUANTA_CUBLAS_CHECK(cublasGemmEx_64(blas_handle(), ta, tb, m, n, k, &alpha, a, CUDA_R_16BF, lda,
                                      b, CUDA_R_16BF, ldb, &beta, c, CUDA_R_32F, ldc,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/** Column-major C [m, n] = alpha op(A) op(B) + beta C, f32 or f64. */
template <class T>
void gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, T alpha,
          const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  cublasHandle_t h = blas_handle();
  if constexpr (std::is_same_v<T, float>)
    QUANTA_CUBLAS_CHECK(cublasSgemm_64(h, ta, tb, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc));
  else
    QUANTA_CUBLAS_CHECK(cublasDgemm_64(h, ta, tb, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc));
}

/** Grid for a grid-stride loop over n items (0 blocks: skip the launch). */
inline cuda::LaunchConfig grid_for(int64_t n) { return cuda::launch_config(n, cuda::max_blocks()); }

/** Grid for one warp per row. */
inline cuda::LaunchConfig warp_grid_for(int64_t rows) { return grid_for(rows * kWarp); }

#define QUANTA_GRID_STRIDE(i, n)                                                         \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// A warp per row: `row` walks this warp's rows, `lane` is its lane.
#define QUANTA_WARP_STRIDE(row, rows)                                                       \
  for (int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp; \
       row < (rows); row += static_cast<int64_t>(gridDim.x) * blockDim.x / kWarp)

/** The sum over a warp's lanes, the same on every lane, in a fixed order. */
template <class T>
__device__ T warp_sum(T v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/** v rounded to `dd` (f32: unchanged; bf16, f16: to nearest even) and
 * widened back to f32, as the CPU's scaled_table does. */
__device__ inline float round_to(float v, DType dd) {
  if (dd == DType::bf16) return __bfloat162float(__float2bfloat16(v));
  if (dd == DType::f16) return __half2float(__float2half(v));
  return v;
}

}  // namespace quanta::quant::quant_cuda
