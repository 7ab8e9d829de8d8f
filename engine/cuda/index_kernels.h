#pragma once
// The CUDA index family's limits (index_kernels.cu; its entries are
// declared in kernels.h).
#include "engine/kernels/table.h"

namespace quanta::cuda {

/** Dims an index_lines operand may have on cuda (its walk is passed by value). */
inline constexpr int kMaxIndexDims = 8;

}  // namespace quanta::cuda
