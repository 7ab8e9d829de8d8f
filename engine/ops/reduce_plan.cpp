#include "engine/ops/reduce_plan.h"

#include <utility>

#include "engine/autograd/grad_mode.h"
#include "engine/ops/view.h"

namespace quanta::detail {
namespace {

// The grid a contiguous tensor of `shape` reduced over `reduced` reads as,
// if any: dims of size 1 dropped, neighbours of one kind merged, and the
// result [kept, reduced, kept, reduced] with the outer kept and the last
// reduced groups optional. Rows ([kept,] reduced) are not a grid: they need
// no copy either.
bool grid_of(const Shape& shape, const std::vector<bool>& reduced, ReduceGrid& g) {
  std::vector<std::pair<int64_t, bool>> groups;  // size, reduced
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    if (!groups.empty() && groups.back().second == reduced[d])
      groups.back().first *= shape[d];
    else
      groups.emplace_back(shape[d], reduced[d]);
  }
  std::size_t at = 0;
  g = ReduceGrid{};
  if (at < groups.size() && !groups[at].second) g.outer = groups[at++].first;
  // What remains: reduced, kept[, reduced].
  const std::size_t rest = groups.size() - at;
  if (rest < 2 || rest > 3) return false;
  g.a = groups[at].first;
  g.keep = groups[at + 1].first;
  if (rest == 3) g.b = groups[at + 2].first;
  return true;
}

}  // namespace

ReducePlan plan_reduce(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim,
                       const char* op, bool grid_ok) {
  NoGradGuard no_grad;
  ReducePlan p;
  const int64_t nd = x.dim();
  p.dims = wrap_dims(dims, nd, op);
  // A 0-d tensor accepts dim 0 / -1 (as PyTorch does) but has no dimension to
  // reduce: the result is the value itself.
  if (nd == 0) p.dims.clear();
  std::vector<bool> reduced(nd, false);
  for (int64_t d : p.dims) reduced[d] = true;
  std::vector<int64_t> order;
  for (int64_t d = 0; d < nd; ++d)
    if (!reduced[d]) {
      order.push_back(d);
      p.outer *= x.shape()[d];
      p.out_shape.push_back(x.shape()[d]);
    }
  for (int64_t d : p.dims) {
    order.push_back(d);
    p.inner *= x.shape()[d];
  }
  p.kept_shape = x.shape();
  for (int64_t d : p.dims) p.kept_shape[d] = 1;
  if (keepdim) p.out_shape = p.kept_shape;
  if (grid_ok && x.numel() > 0 && x.is_contiguous() && grid_of(x.shape(), reduced, p.grid)) {
    p.use_grid = true;
    p.rows = x.detach();
  } else {
    p.rows = contiguous(permute(x.detach(), order));
  }
  return p;
}

void reduce_planned(const KernelTable& k, RowReduce op, const ReducePlan& p, void* out) {
  if (p.use_grid)
    k.reduce_grid(op, p.rows.dtype(), p.rows.raw_data(), p.grid, out);
  else
    k.reduce_rows(op, p.rows.dtype(), p.rows.raw_data(), p.outer, p.inner, out);
}

}  // namespace quanta::detail
