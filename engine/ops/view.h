#pragma once
// Views: new layouts over the same storage, each with its backward.
#include <vector>

#include "engine/tensor.h"

namespace quanta {

/** Same elements in a new shape; one size may be -1. A view when strides
 * allow, else a copy. */
Tensor reshape(const Tensor& x, const Shape& shape);
/** Like reshape but never copies; throws if the layout does not allow it. */
Tensor view(const Tensor& x, const Shape& shape);
Tensor permute(const Tensor& x, const std::vector<int64_t>& dims);
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1);
Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length);
/** Python-style x[start:end:step] along `dim` (clamped bounds, step > 0). */
Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
/** x[index] along `dim`, removing that dim. */
Tensor select(const Tensor& x, int64_t dim, int64_t index);
/** Broadcast size-1 dims (and new leading dims) to `shape`; -1 keeps a size. */
Tensor expand(const Tensor& x, const Shape& shape);
/** Expand to broadcast_shapes(x.shape(), shape). */
Tensor broadcast_to(const Tensor& x, const Shape& shape);
Tensor squeeze(const Tensor& x);
Tensor squeeze(const Tensor& x, int64_t dim);
Tensor unsqueeze(const Tensor& x, int64_t dim);
Tensor flatten(const Tensor& x, int64_t start = 0, int64_t end = -1);
Tensor unflatten(const Tensor& x, int64_t dim, const Shape& sizes);
/** Contiguous copy when needed (identity gradient). */
Tensor contiguous(const Tensor& x);
/** Cast to dtype (gradient cast back); identity when equal. */
Tensor to_dtype(const Tensor& x, DType dtype);
/** Detached view of x. */
Tensor detach(const Tensor& x);

}  // namespace quanta
