#pragma once
// The one GEMM every CPU matrix product goes through (matmul, linear, conv).
// Operands are strided matrices; a plain transpose (one unit stride) maps onto
// the backend with no copy, so transposed views cost nothing. Products of at
// least 2^20 multiply-adds go to oneDNN (f32, -Donednn) or OpenBLAS's OpenMP
// build (-Dblas) where the build found them; the rest, and every product
// without them, to Eigen.
#include <cstdint>

namespace quanta::cpu {

/** A strided matrix operand: element (i, j) lives at p[i * rs + j * cs]. */
template <class T>
struct MatRef {
  const T* p;
  int64_t rs;
  int64_t cs;
};

/** How a rows x cols matrix with strides (rs, cs) maps onto a GEMM: `maps`
 * when it is row-major or column-major with a valid outer stride, `outer`
 * that stride (a dim of 1 takes any stride: outer is then the one a
 * BLAS-style interface accepts). */
struct GemmLayout {
  bool maps = false;
  bool row_major = false;
  int64_t outer = 0;
};
GemmLayout gemm_layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs);

/** True when a rows x cols matrix with strides (rs, cs) maps onto the GEMM
 * without a copy (gemm_layout(...).maps). */
bool gemm_maps(int64_t rows, int64_t cols, int64_t rs, int64_t cs);

/** c[m, n] = a[m, k] b[k, n], or c += a b when `accumulate`; `c` is
 * row-major with row stride ldc. Both operands must satisfy gemm_maps.
 * The backend threads the product unless called inside a parallel region.
 * `bf16_products` (MixedPrecision's f32 products): where the CPU multiplies
 * bf16 natively (bf16_gemm_native()) and the product has at least 2^20
 * multiply-adds and no side under 64, the operands are rounded to bf16 and
 * multiplied through gemm_bf16 (f32 sums); smaller or narrower products
 * (a low-rank adapter's), where the rounding would cost more than it saves,
 * and other CPUs compute in f32. */
template <class T>
void gemm(int64_t m, int64_t n, int64_t k, MatRef<T> a, MatRef<T> b, T* c, int64_t ldc,
          bool accumulate = false, bool bf16_products = false);

/** `batch` products c_i = a_i b_i: a_i starts at a.p + a_off[i] (same for b),
 * c_i at c + i * m * n (contiguous). Parallel over the batch when the
 * products are small or many, else one threaded GEMM after another. */
template <class T>
void gemm_batched(int64_t batch, int64_t m, int64_t n, int64_t k, MatRef<T> a, const int64_t* a_off,
                  MatRef<T> b, const int64_t* b_off, T* c, bool bf16_products = false);

}  // namespace quanta::cpu
