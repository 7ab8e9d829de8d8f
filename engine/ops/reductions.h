#pragma once
// Reductions beyond sum and mean (those live in reduce.h): products, extrema,
// moments, logsumexp, norms, cumulative sums and boolean tests. Empty `dims`
// means all dims; negative dims count from the end. (nd) marks ops without a
// gradient.
//
// Empty reductions follow PyTorch: prod gives 1, all gives true, any gives
// false, logsumexp gives -inf, norm p=1/2 gives 0; max, min, amax, amin,
// argmax, argmin and the inf-norm have no identity and throw, naming the op.
// var/std with fewer than `correction + 1` values divide by zero (NaN or inf).
#include <cmath>
#include <cstdint>

#include "engine/ops/reduce.h"
#include "engine/tensor.h"

namespace quanta {

/** Product over `dims`; floats keep their dtype, integers and bool give i64.
 * The gradient is exact when the input holds zeros. */
Tensor prod(const Tensor& x, const Dims& dims = {}, bool keepdim = false);

/** Values and their positions along the reduced dim (indices are i64). */
struct ValuesIndices {
  Tensor values, indices;
};

/** Largest values along `dim` and the first index of each (NaN wins, as in
 * PyTorch); the gradient goes to that index. */
ValuesIndices max(const Tensor& x, int64_t dim, bool keepdim = false);
/** Smallest values along `dim` and the first index of each. */
ValuesIndices min(const Tensor& x, int64_t dim, bool keepdim = false);
/** Largest element of the whole tensor (0-d); ties share the gradient evenly. */
Tensor max(const Tensor& x);
/** Smallest element of the whole tensor (0-d); ties share the gradient evenly. */
Tensor min(const Tensor& x);
/** Largest values over `dims`; ties share the gradient evenly. */
Tensor amax(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
/** Smallest values over `dims`; ties share the gradient evenly. */
Tensor amin(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
/** (nd) i64 index of the first largest value along `dim`. */
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);
/** (nd) i64 index of the first smallest value along `dim`. */
Tensor argmin(const Tensor& x, int64_t dim, bool keepdim = false);

/** Variance over `dims`: sum of squared deviations / max(0, N - correction). */
Tensor var(const Tensor& x, const Dims& dims = {}, double correction = 1.0, bool keepdim = false);
/** sqrt(var(...)); the gradient where std is 0 is 0, as in PyTorch. */
Tensor std(const Tensor& x, const Dims& dims = {}, double correction = 1.0, bool keepdim = false);

/** log(sum(exp(x))) over `dims`, computed stably; all -inf (or empty) gives -inf. */
Tensor logsumexp(const Tensor& x, const Dims& dims = {}, bool keepdim = false);

/** Vector p-norm over `dims` for p > 0 or p = INFINITY (max |x|). The gradient
 * at a zero vector is 0. */
Tensor norm(const Tensor& x, double p = 2.0, const Dims& dims = {}, bool keepdim = false);

/** Running sum along `dim`; floats keep their dtype, integers and bool give i64. */
Tensor cumsum(const Tensor& x, int64_t dim);

/** (nd) bool: every element over `dims` is non-zero (true when empty). */
Tensor all(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
/** (nd) bool: some element over `dims` is non-zero (false when empty). */
Tensor any(const Tensor& x, const Dims& dims = {}, bool keepdim = false);

}  // namespace quanta
