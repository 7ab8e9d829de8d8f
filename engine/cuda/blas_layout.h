#pragma once
// How a strided matrix operand is handed to a column-major BLAS (cuBLAS):
// as row-major or column-major storage with a leading dimension. Plain C++
// so the CPU tests check it.
#include <algorithm>
#include <cstdint>

namespace quanta::cuda {

struct BlasLayout {
  bool ok = false;         // false: copy the operand to a contiguous one first
  bool row_major = false;  // element (i, j) at i * ld + j; else at i + j * ld
  int64_t ld = 1;
};

/** The layout of a rows x cols matrix whose element (i, j) lives at
 * i * rs + j * cs. A dim of size 1 may have any stride. BLAS needs the
 * leading dimension at least the length of the contiguous side. */
inline BlasLayout blas_layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  const int64_t r1 = std::max<int64_t>(rows, 1), c1 = std::max<int64_t>(cols, 1);
  if ((cs == 1 || cols <= 1) && (rows <= 1 || rs >= c1)) return {true, true, rows <= 1 ? c1 : rs};
  if ((rs == 1 || rows <= 1) && (cols <= 1 || cs >= r1)) return {true, false, cols <= 1 ? r1 : cs};
  return {};
}

}  // namespace quanta::cuda
