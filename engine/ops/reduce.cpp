// sum, mean and sum_to: the reductions autograd itself needs. The other
// reductions live in reductions.cpp.
#include "engine/ops/reduce.h"

#include "engine/autograd/node.h"
#include "engine/kernels/table.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/kernel_call.h"
#include "engine/ops/reduce_plan.h"
#include "engine/ops/view.h"

namespace quanta {
namespace {

// Gradient of a reduction: g broadcast back over the reduced dims.
Tensor expand_back(const Tensor& g, const Shape& kept_shape, const Shape& in_shape) {
  return expand(reshape(g, kept_shape), in_shape);
}

}  // namespace

Tensor sum(const Tensor& x, const Dims& dims, bool keepdim) {
  const KernelTable& k = kernels_for("sum", {&x});
  const DType out_dt = is_floating(x.dtype()) ? x.dtype() : DType::i64;
  const DType ct = detail::compute_dtype(out_dt);
  // 16-bit input: read as it is where the device reduces it in f32.
  const bool widen = detail::compute_dtype(x.dtype()) != x.dtype() && !k.half_reductions;
  Tensor src = widen ? detail::as_plain(x, ct) : x;
  auto p = detail::plan_reduce(src, dims, keepdim, "sum", true);
  Tensor out = detail::make_tensor(p.out_shape, ct, x.device());
  detail::reduce_planned(k, RowReduce::sum, p, out.raw_data());
  if (ct != out_dt) out = detail::as_plain(out, out_dt);
  return autograd::record("sum", out, {x}, [kept = p.kept_shape, in = x.shape()](const Tensor& g) {
    return std::vector<Tensor>{expand_back(g, kept, in)};
  });
}

Tensor mean(const Tensor& x, const Dims& dims, bool keepdim) {
  if (!is_floating(x.dtype()))
    throw std::invalid_argument(std::string("[mean] needs a floating tensor, got ") +
                                dtype_name(x.dtype()));
  const auto wrapped = wrap_dims(dims, x.dim(), "mean");
  int64_t count = 1;
  // A 0-d tensor takes dim 0 / -1 but reduces over nothing (count 1).
  if (x.dim() > 0)
    for (int64_t d : wrapped) count *= x.shape()[d];
  // 0 / 0 gives NaN for an empty reduction, as in NumPy and PyTorch.
  return div(sum(x, dims, keepdim), constant_like(x, static_cast<double>(count)));
}

Tensor sum_to(const Tensor& x, const Shape& shape) {
  if (x.shape() == shape) return x;
  const int64_t lead = x.dim() - static_cast<int64_t>(shape.size());
  if (lead < 0)
    throw std::invalid_argument("[sum_to] cannot sum shape " + shape_str(x.shape()) + " to " +
                                shape_str(shape));
  Dims dims;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (d < lead) {
      dims.push_back(d);
    } else if (shape[d - lead] == 1 && x.shape()[d] != 1) {
      dims.push_back(d);
    } else if (shape[d - lead] != x.shape()[d]) {
      throw std::invalid_argument("[sum_to] cannot sum shape " + shape_str(x.shape()) + " to " +
                                  shape_str(shape));
    }
  }
  if (dims.empty()) return reshape(x, shape);
  return reshape(sum(x, dims, true), shape);
}

}  // namespace quanta
