#pragma once
// Normalisation layers as functions, composed from reductions and elementwise
// ops (so the gradient comes from those). Both use the biased variance, as in
// PyTorch.
#include <cstdint>

#include "engine/tensor.h"

namespace quanta {

/** Normalises `x` over its trailing dims `normalized_shape` to zero mean and
 * unit variance, then applies the optional affine `weight` and `bias` (both of
 * shape `normalized_shape`; undefined = none). */
Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight = {},
                  const Tensor& bias = {}, double eps = 1e-5);
/** Normalises `x` [N, C, *] over each of `num_groups` groups of C / num_groups
 * channels (and all of *), then applies the optional per-channel `weight` and
 * `bias` [C]. */
Tensor group_norm(const Tensor& x, int64_t num_groups, const Tensor& weight = {},
                  const Tensor& bias = {}, double eps = 1e-5);

}  // namespace quanta
