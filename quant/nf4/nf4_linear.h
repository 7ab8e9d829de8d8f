#pragma once
// Linear layer math with a frozen NF4 weight: y = x W^T + b where W is an nf4
// tensor [out, in]. The weight is dequantized tile by tile into a small
// buffer (never as a whole), or, for a batch of at most 8 rows with
// in % 64 == 0, decoded on the fly while the packed bytes are read once.
#include "engine/tensor.h"

namespace quanta::quant {

/** Rows up to which nf4_linear uses the fused decode-and-dot path. */
inline constexpr int64_t kNF4FusedMaxBatch = 8;

/** x [..., in] (f32 or f64) times the nf4 weight w [out, in] transposed, plus
 * bias [out] (undefined: none); returns [..., out] in x's dtype. Backward
 * gives the gradients of x and bias; the nf4 weight is frozen (nf4 tensors
 * cannot require grad). */
Tensor nf4_linear(const Tensor& x, const Tensor& w, const Tensor& bias = Tensor());

}  // namespace quanta::quant
