#pragma once
// The hot path of every VQ layer: for each row of x, the index of the nearest
// codebook row. Distances are one GEMM plus norms, computed a block of rows at
// a time so memory beyond the inputs stays O(block x K), never O(N x K).
#include "engine/tensor.h"

namespace quanta::quant {

/** Index (i64 [N]) of the nearest row of `codes` [K, D] for every row of
 * `x` [N, D]: the smallest |x - c|^2, or with `cosine` the largest dot
 * product x.c (rows are assumed unit-norm). Ties go to the first index.
 * No gradient; f32 or f64, on any device with a nearest_codes kernel
 * (quant/kernels/table.h). K must be > 0 unless N is 0. */
Tensor nearest_codes(const Tensor& x, const Tensor& codes, bool cosine);

/** x / max(|x|, eps) along the last dim (differentiable), like
 * torch.nn.functional.normalize. */
Tensor l2norm(const Tensor& x, double eps = 1e-6);

}  // namespace quanta::quant
