#include "engine/ops/reduce_plan.h"

#include "engine/autograd/grad_mode.h"
#include "engine/ops/view.h"

namespace quanta::detail {

ReducePlan plan_reduce(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim,
                       const char* op) {
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
  p.rows = contiguous(permute(x.detach(), order));
  return p;
}

}  // namespace quanta::detail
