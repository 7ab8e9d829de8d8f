#pragma once
// Pieces the FSQ and LFQ families share: the fixed random rotation, the input
// soft clamp and layouts. (Token masks are
// quant/token_layout.h's, the quantize-dropout draw quant/quantize_dropout.h's.)
#include <cstdint>
#include <string>

#include "engine/random/generator.h"
#include "engine/tensor.h"
#include "quant/streams.h"
#include "quant/token_layout.h"

namespace quanta::quant::detail {

/** A random n x n orthogonal matrix (f32): Gram-Schmidt on a normal matrix
 * drawn from `gen`, computed in f64. */
Tensor random_orthogonal(int64_t n, Generator& gen);

/** tanh(x / v) * v: a smooth clamp to (-v, v) (v broadcasts over x). */
Tensor soft_clamp(const Tensor& x, const Tensor& v);

/** [B, ..., D] to [B, D, ...] (features to dim 1), as channel-first outputs. */
Tensor features_to_dim1(const Tensor& x);

}  // namespace quanta::quant::detail
