// GEMM on CUDA through cuBLAS: f32 without TF32, f64; bf16 and f16 with f32
// compute (one rounding of C, as the CPU's f32 product of widened operands).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <mutex>
#include <vector>

#include "engine/cuda/blas_handle.h"
#include "engine/cuda/blas_layout.h"
#include "engine/cuda/check.cuh"
#include "engine/cuda/device_types.cuh"
#include "engine/cuda/kernels.h"
#include "engine/kernels/table.h"

namespace quanta::cuda {

// The size NVIDIA's cuBLAS guide suggests for Hopper; less is enough on
// older GPUs.
constexpr std::size_t kBlasWorkspaceBytes = 32u << 20;

namespace {

// A handle for GPU `device` (current on entry), set up as blas_handle.h says.
cublasHandle_t new_blas_handle(int device) {
  cublasHandle_t h = nullptr;
  QUANTA_CUBLAS_CHECK(cublasCreate(&h));
  QUANTA_CUBLAS_CHECK(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
  QUANTA_CUBLAS_CHECK(cublasSetStream(h, stream_of(device)));
  // After cublasSetStream, which resets the workspace to cuBLAS's own.
  void* workspace = nullptr;
  QUANTA_CUDA_CHECK(cudaMalloc(&workspace, kBlasWorkspaceBytes));
  QUANTA_CUBLAS_CHECK(cublasSetWorkspace(h, workspace, kBlasWorkspaceBytes));
  return h;
}

}  // namespace

cublasHandle_t blas_handle() {
  static std::mutex mu;
  static std::vector<cublasHandle_t> handles;
  int dev = 0;
  QUANTA_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<int>(handles.size()) <= dev) handles.resize(dev + 1, nullptr);
  if (!handles[dev]) {
    // Plain f32 arithmetic: TF32 would change results by ~1e-3.
    handles[dev] = new_blas_handle(dev);
  }
  return handles[dev];
}

namespace {

// The arithmetic progression step of offs[0..n) (0 for one product), or -1.
int64_t progression(const int64_t* offs, int64_t n) {
  if (!offs || n == 1) return 0;
  const int64_t step = offs[1] - offs[0];
  for (int64_t i = 0; i < n; ++i)
    if (offs[i] != offs[0] + i * step) return -1;
  return offs[0] == 0 ? step : -1;
}

// One element type's cuBLAS calls: single and strided-batched products
// (column-major arguments, as cuBLAS names them). f32 and f64 use
// Sgemm/Dgemm; bf16 and f16 use the Ex forms with f32 compute (tensor cores;
// one rounding of C, as the CPU's f32 product of widened operands).
template <class T>
struct Blas {
  using Scalar = std::conditional_t<std::is_same_v<T, double>, double, float>;
  static cudaDataType data_type() {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) return CUDA_R_16BF;
    if constexpr (std::is_same_v<T, __half>) return CUDA_R_16F;
    if constexpr (std::is_same_v<T, float>) return CUDA_R_32F;
    return CUDA_R_64F;
  }
  // cuBLAS's compute type: f32 sums; an f32 product under MixedPrecision
  // lets cuBLAS round its operands to bf16 for the tensor cores.
  static cublasComputeType_t compute(bool bf16_products) {
    return std::is_same_v<T, float> && bf16_products ? CUBLAS_COMPUTE_32F_FAST_16BF
                                                     : CUBLAS_COMPUTE_32F;
  }
  static void one(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int64_t m,
                  int64_t n, int64_t k, const Scalar* alpha, const T* a, int64_t lda, const T* b,
                  int64_t ldb, const Scalar* beta, T* c, int64_t ldc, bool bf16_products) {
    if constexpr (std::is_same_v<T, double>) {
      QUANTA_CUBLAS_CHECK(cublasDgemm_64(h, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc));
    } else {
      if constexpr (std::is_same_v<T, float>) {
        if (!bf16_products) {
          QUANTA_CUBLAS_CHECK(
              cublasSgemm_64(h, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc));
          return;
        }
      }
      QUANTA_CUBLAS_CHECK(cublasGemmEx_64(h, ta, tb, m, n, k, alpha, a, data_type(), lda, b,
                                          data_type(), ldb, beta, c, data_type(), ldc,
                                          compute(bf16_products), CUBLAS_GEMM_DEFAULT));
    }
  }
  static void strided(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int64_t m,
                      int64_t n, int64_t k, const Scalar* alpha, const T* a, int64_t lda,
                      int64_t sa, const T* b, int64_t ldb, int64_t sb, const Scalar* beta, T* c,
                      int64_t ldc, int64_t sc, int64_t batch, bool bf16_products) {
    if constexpr (std::is_same_v<T, double>) {
      QUANTA_CUBLAS_CHECK(cublasDgemmStridedBatched_64(h, ta, tb, m, n, k, alpha, a, lda, sa, b,
                                                       ldb, sb, beta, c, ldc, sc, batch));
    } else {
      if constexpr (std::is_same_v<T, float>) {
        if (!bf16_products) {
          QUANTA_CUBLAS_CHECK(cublasSgemmStridedBatched_64(h, ta, tb, m, n, k, alpha, a, lda, sa, b,
                                                           ldb, sb, beta, c, ldc, sc, batch));
          return;
        }
      }
      QUANTA_CUBLAS_CHECK(cublasGemmStridedBatchedEx_64(
          h, ta, tb, m, n, k, alpha, a, data_type(), lda, sa, b, data_type(), ldb, sb, beta, c,
          data_type(), ldc, sc, batch, compute(bf16_products), CUBLAS_GEMM_DEFAULT));
    }
  }
};

template <class T>
void gemm_typed(const GemmArgs& g) {
  // Row-major C = A B is column-major C^T = B^T A^T: cuBLAS's first operand
  // is B^T (n x k), its second A^T (k x m).
  const BlasLayout lb = blas_layout(g.k, g.n, g.b.rs, g.b.cs);
  const BlasLayout la = blas_layout(g.m, g.k, g.a.rs, g.a.cs);
  if (!lb.ok || !la.ok) throw std::logic_error("[gemm] operand layout cuBLAS cannot take");
  // A row-major matrix is its transpose in column-major: no transpose needed.
  const cublasOperation_t opb = lb.row_major ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t opa = la.row_major ? CUBLAS_OP_N : CUBLAS_OP_T;
  using S = typename Blas<T>::Scalar;
  const S alpha = S(1), beta = g.accumulate ? S(1) : S(0);
  const T* a = static_cast<const T*>(g.a.data);
  const T* b = static_cast<const T*>(g.b.data);
  T* c = static_cast<T*>(g.c);
  if (g.k == 0) {  // an empty sum: C = 0, or C unchanged when accumulating
    if (!g.accumulate)
      QUANTA_CUDA_CHECK(
          cudaMemset2DAsync(c, sizeof(T) * g.ldc, 0, sizeof(T) * g.n, g.m * g.batch, stream()));
    return;
  }
  cublasHandle_t h = blas_handle();
  auto one = [&](const T* pa, const T* pb, T* pc) {
    Blas<T>::one(h, opb, opa, g.n, g.m, g.k, &alpha, pb, lb.ld, pa, la.ld, &beta, pc, g.ldc,
                 g.bf16_products);
  };
  if (g.batch == 1) {
    one(a + (g.a_off ? g.a_off[0] : 0), b + (g.b_off ? g.b_off[0] : 0), c);
    return;
  }
  const int64_t sa = progression(g.a_off, g.batch), sb = progression(g.b_off, g.batch);
  const int64_t sc = g.m * g.ldc;
  if (sa < 0 || sb < 0) {
    for (int64_t i = 0; i < g.batch; ++i)
      one(a + (g.a_off ? g.a_off[i] : 0), b + (g.b_off ? g.b_off[i] : 0), c + i * sc);
    return;
  }
  Blas<T>::strided(h, opb, opa, g.n, g.m, g.k, &alpha, b, lb.ld, sb, a, la.ld, sa, &beta, c, g.ldc,
                   sc, g.batch, g.bf16_products);
}

}  // namespace

bool gemm_maps(int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  return blas_layout(rows, cols, rs, cs).ok;
}

void gemm(const GemmArgs& g) {
  if (g.batch == 0 || g.m == 0 || g.n == 0) return;
  switch (g.dtype) {
    case DType::f32:
      return gemm_typed<float>(g);
    case DType::f64:
      return gemm_typed<double>(g);
    case DType::bf16:
      return gemm_typed<__nv_bfloat16>(g);
    case DType::f16:
      return gemm_typed<__half>(g);
    default:
      bad_dtype("gemm", g.dtype, "expected f32, f64, bf16 or f16");
  }
}

}  // namespace quanta::cuda
