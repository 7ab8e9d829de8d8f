#pragma once
// nf4_linear's fused small-batch path on CUDA (nf4_gemv.cu), for
// nf4_kernels.cu: called when plans.h's nf4_use_gemv says so.
#include <cstdint>

#include "engine/dtype.h"
#include "quant/kernels/nf4_layout.h"

namespace quanta::quant::quant_cuda {

/** y [m, n] = x [m, k] W^T (+ bias [n] when not null), W the [n, k] weight of
 * w dequantized in registers (dd: f32, bf16 or f16), x, bias and y contiguous
 * on the current device; T float or double. Needs nf4_use_gemv(m, k, n, w).
 * Queued on cuda::stream(). */
template <class T>
void nf4_gemv(const T* x, int64_t m, int64_t k, const NF4Runs& w, DType dd, int64_t n,
              const T* bias, T* y);

}  // namespace quanta::quant::quant_cuda
