#pragma once
// Matrix products. On the CPU all of them run on one GEMM entry
// (engine/cpu/gemm.h: OpenBLAS where the build found it, else Eigen's own):
// f32 and f64 are computed as they are, bf16 and f16 are computed in f32 and
// stored back, integer and bool operands are refused with an error naming the
// op (cast them to a floating dtype first). Mixed dtypes promote. Under
// MixedPrecision (engine/precision.h) f32 products other than sq_dist's
// round their operands to bf16 where the device multiplies bf16 faster.
#include "engine/tensor.h"

namespace quanta {

/** Matrix product with NumPy/PyTorch rules: 1-d . 1-d is a dot product (0-d
 * result); a 1-d left (right) operand is a row (column) vector whose dim is
 * removed from the result; otherwise the last two dims multiply and the
 * leading (batch) dims broadcast. */
Tensor matmul(const Tensor& a, const Tensor& b);

/** x [..., in] times w [out, in] transposed, plus b [out] (undefined b: no
 * bias); returns [..., out]. The bias is folded into the GEMM. */
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b = Tensor());

/** c + linear(x, w), c of the product's shape [..., out]: the GEMM adds onto
 * c instead of a product and an add (a LoRA term onto its frozen layer's
 * output). c is taken by value: one handed over with std::move whose storage
 * nothing else holds (sole_storage: no other handle, no backward that kept
 * it) and of the product's dtype becomes the output's storage, the product
 * added in place; otherwise the GEMM adds onto a copy of c. The gradient of
 * c is the output's gradient. */
Tensor linear_add(Tensor c, const Tensor& x, const Tensor& w);

/** Batched product of 3-d tensors: a [B, m, k], b [B, k, n] -> [B, m, n]
 * (no broadcasting). */
Tensor bmm(const Tensor& a, const Tensor& b);

/** Outer product of 1-d a [n] and b [m]: [n, m]. */
Tensor outer(const Tensor& a, const Tensor& b);

/** Squared Euclidean distances between the rows of x [N, D] and of c [K, D]:
 * [N, K] = |x|^2 - 2 x c^T + |c|^2 (one GEMM), clamped at 0. */
Tensor sq_dist(const Tensor& x, const Tensor& c);

}  // namespace quanta
