#pragma once
// dst [batch, q, p] = src [batch, p, q]: a batch of matrices transposed
// through a kernel table's strided copy entry. Device code that computes in
// one layout uses it to serve the other: the CUDA convolutions run
// channels-last activations on their channels-first im2col path, and hand
// cuDNN the weight as the [O, kh, kw, C] filter its channels-last
// algorithms read.
#include <array>
#include <cstdint>

#include "engine/kernels/table.h"

namespace quanta {

/** A table's copy entry (KernelTable::copy). */
using CopyEntry = void (*)(const Shape& shape, const Operand& dst, const Operand& src);

/** dst [batch, q, p] = src [batch, p, q], both contiguous and of `dtype`,
 * by one call of `copy`. */
inline void copy_transposed(CopyEntry copy, DType dtype, int64_t batch, int64_t p, int64_t q,
                            const void* src, void* dst) {
  const Shape shape{batch, q, p};
  const std::array<int64_t, 3> dst_strides{q * p, p, 1}, src_strides{p * q, 1, q};
  copy(shape, Operand{dst, dtype, dst_strides.data()},
       Operand{const_cast<void*>(src), dtype, src_strides.data()});
}

}  // namespace quanta
