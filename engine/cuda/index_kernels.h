#pragma once
// The CUDA index family's table entries (index_kernels.cu).
#include "engine/kernels/table.h"

namespace quanta::cuda {

/** Dims an index_lines operand may have on cuda (its walk is passed by value). */
inline constexpr int kMaxIndexDims = 8;

void index_select(DType dtype, const void* src, int64_t outer, int64_t n, int64_t inner,
                  const int64_t* idx, int64_t m, void* out);
void index_lines(IndexMode mode, const Shape& shape, int64_t dim, const Operand& idx,
                 const Operand& out, const Operand& src, double value);
void index_add(DType dtype, void* out, int64_t outer, int64_t n, int64_t inner, const int64_t* idx,
               int64_t m, const void* src, double alpha);
void checked_indices(const int64_t* idx, int64_t n, int64_t size, int64_t* safe,
                     DeviceErrorFlag* flag, int32_t check);

}  // namespace quanta::cuda
