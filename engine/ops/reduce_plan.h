#pragma once
// Lays a tensor out for a reduction. Kept dims first and reduced dims last is
// the layout of the kernel tables' row reductions: every output element
// reduces one contiguous row of `inner` values. A contiguous tensor whose
// reduced dims lead or sit between kept ones (a bias gradient's [rows, cols]
// over rows, NCHW over N, H and W) is read in place by the grid reduction
// instead; anything else becomes rows through one strided copy on the
// tensor's own device.
#include <vector>

#include "engine/kernels/table.h"
#include "engine/tensor.h"

namespace quanta::detail {

struct ReducePlan {
  Tensor rows;                // contiguous; [outer, inner] rows, or the input laid out as `grid`
  bool use_grid = false;      // rows is read as grid (reduce_grid), not as rows
  ReduceGrid grid;            // when use_grid
  int64_t outer = 1;          // number of output elements
  int64_t inner = 1;          // values reduced into each
  Shape out_shape;            // result shape (keepdim applied)
  Shape kept_shape;           // result shape with reduced dims kept as size 1
  std::vector<int64_t> dims;  // wrapped, sorted reduced dims
};

/** Plans reducing `x` over `dims` (empty = all); no graph is recorded.
 * `grid_ok`: the op has a grid reduction (reduce_grid's ops), so a
 * contiguous x need not be copied into rows. */
ReducePlan plan_reduce(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim,
                       const char* op, bool grid_ok = false);

/** Runs reduce_rows' `op` over a plan into out (p.outer elements): the grid
 * reduction when the plan has one, else the rows. */
void reduce_planned(const KernelTable& k, RowReduce op, const ReducePlan& p, void* out);

}  // namespace quanta::detail
