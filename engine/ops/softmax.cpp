// softmax and log_softmax: the device's stable softmax kernel over
// [outer, n, inner] lines and the two hand-written backward formulas.
#include "engine/ops/softmax.h"

#include <vector>

#include "engine/autograd/node.h"
#include "engine/dispatch.h"
#include "engine/kernels/table.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/kernel_call.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"

namespace quanta {
namespace {

template <bool Log>
Tensor softmax_impl(const Tensor& x, int64_t dim, const char* op) {
  const KernelTable& k = kernels_for(op, {&x});
  if (!dtype_info(x.dtype()).arithmetic)
    detail::bad_dtype(op, x.dtype(), "a byte-only format: dequantize it first");
  if (x.dim() == 0) {
    // A 0-d tensor is one slice of one element (dims 0 and -1 accepted).
    wrap_dim(dim, 0, op);
    return reshape(softmax_impl<Log>(reshape(x, {1}), 0, op), {});
  }
  const int64_t d = wrap_dim(dim, x.dim(), op);
  const DType out_dt = to_floating(x.dtype());
  const DType ct = detail::compute_dtype(out_dt);
  const Tensor in = detail::as_plain(x, ct).contiguous();
  Tensor out = detail::make_tensor(x.shape(), ct, x.device());
  int64_t outer = 1, inner = 1;
  for (int64_t j = 0; j < d; ++j) outer *= x.shape()[j];
  for (int64_t j = d + 1; j < x.dim(); ++j) inner *= x.shape()[j];
  k.softmax(Log, ct, in.raw_data(), outer, x.shape()[d], inner, out.raw_data());
  if (ct != out_dt) out = detail::as_plain(out, out_dt);
  return autograd::record(op, out, {x}, [y = out.detach(), d](const Tensor& g) {
    // softmax: y (g - sum(g y)); log_softmax: g - exp(y) sum(g).
    if constexpr (Log)
      return std::vector<Tensor>{sub(g, mul(exp(y), sum(g, {d}, true)))};
    else
      return std::vector<Tensor>{mul(y, sub(g, sum(mul(g, y), {d}, true)))};
  });
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) { return softmax_impl<false>(x, dim, "softmax"); }

Tensor log_softmax(const Tensor& x, int64_t dim) {
  return softmax_impl<true>(x, dim, "log_softmax");
}

}  // namespace quanta
