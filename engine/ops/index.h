#pragma once
// Indexing ops: selecting, gathering and scattering by integer index tensors
// (i64, or i32), masking by bool tensors, and embedding lookup. Indices are
// bounds-checked before any kernel runs. Out-of-place throughout: `x` is never
// modified. The masks and index tensors themselves get no gradient.
#include <cstdint>

#include "engine/tensor.h"

namespace quanta {

/** Slices of `x` at positions `index` (0-d or 1-d) along `dim`; the result
 * has x's shape with size index.numel() in `dim`. */
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
/** out[i][j][k] = x[i][index[i][j][k]][k] for dim 1 (and likewise for any
 * dim); index has x's rank, the result has index's shape. */
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
/** A copy of `x` with out[i][index[i][j][k]][k] = src[i][j][k] (dim 1);
 * src must cover index's shape. With duplicate targets the last write (in
 * row-major order of index) wins. */
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
/** A copy of `x` with `value` written at the positions `index` points to. */
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, double value);
/** A copy of `x` with src[i][j][k] added into out[i][index[i][j][k]][k]
 * (dim 1); duplicate targets accumulate. x is taken by value: one handed
 * over with std::move whose storage nothing else holds (sole_storage) is
 * written in place instead of copied. */
Tensor scatter_add(Tensor x, int64_t dim, const Tensor& index, const Tensor& src);
/** A copy of `x` with alpha * src's slice j added into x's slice index[j]
 * along `dim` (index 0-d or 1-d; src has x's shape except index.numel() in
 * `dim`); duplicate indices accumulate. */
Tensor index_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
                 double alpha = 1);
/** x with `value` wherever the bool `mask` is true (mask and x broadcast). */
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);
/** The elements of x where the bool `mask` is true (both broadcast), as a 1-d
 * tensor in row-major order. */
Tensor masked_select(const Tensor& x, const Tensor& mask);
/** The row-major positions (i64, 1-d, on mask's device) where the bool
 * `mask` is true: for a 1-d mask, the indices of its true elements. Its
 * size depends on the values, so the mask is read on the host. */
Tensor nonzero(const Tensor& mask);
/** Rows of `weight` [V, D] at `indices` (any shape): indices.shape + [D].
 * Row `padding_idx` (in [0, V); -1 = none) receives no gradient. */
Tensor embedding(const Tensor& weight, const Tensor& indices, int64_t padding_idx = -1);

namespace detail {
/** `index` (contiguous i64) checked to lie in [0, size) as the index ops
 * check theirs: on the CPU at once, throwing "[op] index v is out of bounds
 * for dim d with size n"; on a device by the device (engine/device_error.h),
 * reported at the next read of it. Use the returned tensor: on a device it
 * is a copy in which a bad index reads as 0. */
Tensor checked_index(const char* op, const Tensor& index, int64_t dim, int64_t size);
}  // namespace detail

}  // namespace quanta
