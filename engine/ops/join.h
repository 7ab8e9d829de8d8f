#pragma once
// Joining, splitting and rearranging whole tensors: cat, stack, split, chunk,
// flip, repeat, pad. Every op has a gradient.
#include <cstdint>
#include <vector>

#include "engine/tensor.h"

namespace quanta {

/** Concatenation along `dim`; shapes must match except in `dim`, dtypes are
 * promoted. Zero-size pieces are allowed. */
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
/** Joins equal-shaped tensors along a new dim `dim` (in [-(n+1), n]). */
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);

namespace detail {
/** cat's copy without the graph: `pieces` (defined, on out's device, of
 * out's shape but along `dim`) one after another along `dim` into `out`
 * (contiguous, their sizes along dim summing to its own). The contiguous
 * pieces of out's dtype go in one copy_blocks call, the others by a
 * strided copy each. */
void copy_pieces(const Tensor& out, int64_t dim, const std::vector<Tensor>& pieces);
}  // namespace detail
/** Views of consecutive `split_size`-long pieces along `dim` (the last may be
 * shorter), like torch.split with an int. */
std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim = 0);
/** Views of pieces with the given sizes along `dim` (they must sum to its size). */
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim = 0);
/** At most `chunks` views along `dim`, each ceil(size / chunks) long (the last
 * shorter), following torch.chunk. */
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim = 0);
/** A copy with the order of elements reversed along each of `dims`. */
Tensor flip(const Tensor& x, const std::vector<int64_t>& dims);
/** Tiles `x` `repeats[i]` times along each dim, like torch.Tensor.repeat
 * (`repeats` may have more dims than x; the new ones lead). */
Tensor repeat(const Tensor& x, const Shape& repeats);
/** Constant padding with F.pad's convention: `pads` holds (before, after)
 * pairs starting from the last dim; negative pads crop. */
Tensor pad(const Tensor& x, const std::vector<int64_t>& pads, double value = 0);

}  // namespace quanta
