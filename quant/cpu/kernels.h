#pragma once
// The CPU quantizer table's entries, one family per file (nearest_kernels,
// commitment_kernels, rotation_kernels, codebook_kernels, lfq_kernels,
// nf4_kernels, nf4_linear_kernels); kernel_table.cpp puts them in the table.
// Contracts: quant/kernels/table.h. Nothing here includes a layer header
// (quant/vq, quant/scalar, quant/nf4), engine/ops or engine/autograd.
#include <vector>

#include "quant/kernels/table.h"

namespace quanta::quant::quant_cpu {

/** Per-row 1/0 weights of a row mask (u8 [rows]), or empty when `valid` is
 * null (every row counts). */
template <class T>
std::vector<T> row_weights(const uint8_t* valid, int64_t rows) {
  if (!valid) return {};
  return std::vector<T>(valid, valid + rows);
}

void nearest_codes(DType dtype, const void* x, const void* codes, int64_t n, int64_t k, int64_t d,
                   bool cosine, int64_t* out);
void squared_error(DType dtype, const void* x, const void* q, const uint8_t* valid, int64_t rows,
                   int64_t d, double* out);
void squared_error_grad(DType dtype, const void* x, const void* q, const uint8_t* valid,
                        int64_t rows, int64_t d, const double* scale, void* gx);
void route_grad(bool rotation, DType dtype, const void* x, const void* q, const void* g,
                const uint8_t* valid, const double* coef, int64_t rows, int64_t d, void* gx);
void put_rows(DType dtype, void* dst, int64_t d, const int64_t* at, int64_t m, const void* src,
              double scale);
void code_statistics(DType dtype, const int64_t* idx, const void* x, int64_t n, int64_t k,
                     int64_t d, void* counts, void* sums);
void bit_product(DType dtype, const void* pi, int64_t rows, int64_t k, void* out);
void bit_product_grad(DType dtype, const void* pi, const void* grad_out, int64_t rows, int64_t k,
                      void* grad_pi);
void clamped_entropy(const double* z, int64_t rows, int64_t d, double* h, double* grad);
void nf4_absmax(const float* x, int64_t n, int64_t block, float* absmax);
void nf4_encode(const float* x, int64_t n, int64_t block, const float* absmax, const float* stored,
                const NF4RunsOut& out);
void nf4_decode(const NF4Runs& w, DType dtype, void* out);
void nf4_linear(DType dtype, const void* x, int64_t m, int64_t k, const NF4Runs& w, DType dequant,
                int64_t n, const void* bias, void* y);
void nf4_linear_grad(DType dtype, const void* g, int64_t m, int64_t n, const NF4Runs& w,
                     DType dequant, int64_t k, void* dx);

/** Elements [begin, begin + count) of w as T (float or double): each the f32
 * product value(code) * scale rounded to `dtype` (f32, bf16 or f16). Shared
 * by the decode and the nf4_linear kernels. */
template <class T>
void nf4_decode_range(const NF4Runs& w, int64_t begin, int64_t count, DType dtype, T* out);

}  // namespace quanta::quant::quant_cpu
