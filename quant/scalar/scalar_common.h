#pragma once
// Pieces the FSQ and LFQ families share: the fixed random rotation, the input
// soft clamp, token masks and the residual quantize-dropout draw.
#include <cstdint>
#include <string>

#include "engine/random/generator.h"
#include "engine/tensor.h"
#include "quant/token_layout.h"

namespace quanta::quant::detail {

/** A random n x n orthogonal matrix (f32): Gram-Schmidt on a normal matrix
 * drawn from `gen`, computed in f64. */
Tensor random_orthogonal(int64_t n, Generator& gen);

/** tanh(x / v) * v: a smooth clamp to (-v, v) (v broadcasts over x). */
Tensor soft_clamp(const Tensor& x, const Tensor& v);

/** The mask of `layout`'s input as a bool [B, N] tensor (mask [B, N] or of the
 * input's spatial shape); undefined when `mask` is. Errors name `who`. */
Tensor token_mask(const Tensor& mask, const TokenLayout& layout, const std::string& who);

/** [B, ..., D] to [B, D, ...] (features to dim 1), as channel-first outputs. */
Tensor features_to_dim1(const Tensor& x);

/** The flat positions (i64, [T]) where a bool tensor is true. */
Tensor true_positions(const Tensor& mask);

/** The seed of sub-layer `name` of a module seeded with `seed`. */
uint64_t child_seed(uint64_t seed, const std::string& name);

/** The last layer kept by quantize dropout: uniform in [cutoff, num_layers - 1]
 * from `gen`, rounded up so that (k + 1) is a multiple of `multiple_of`
 * (capped at num_layers - 1). */
int64_t draw_dropout_layer(Generator& gen, int64_t num_layers, int64_t cutoff, int64_t multiple_of);

}  // namespace quanta::quant::detail
