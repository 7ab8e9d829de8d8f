#pragma once
// Pieces the FSQ and LFQ families share: the fixed random rotation, the input
// soft clamp and layouts. (Token masks are
// quant/token_layout.h's, the quantize-dropout draw quant/quantize_dropout.h's.)
#include <cstdint>
#include <string>
#include <vector>

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

/** The mixed-radix digits of integer `indices` [...] (digit i = index /
 * basis[i] mod levels[i]) as int32 [..., len(levels)], on indices' device.
 * Read on the host: throws std::invalid_argument naming `who` for float
 * indices or an index outside [0, codebook_size). */
Tensor index_digits(const Tensor& indices, const std::vector<int64_t>& basis,
                    const std::vector<int64_t>& levels, int64_t codebook_size,
                    const std::string& who);

}  // namespace quanta::quant::detail
