#include "dist/functional.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

#include "engine/autograd/function.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/view.h"

namespace quanta::dist::fn {
namespace {

// A private contiguous copy: collectives work in place, and gradients handed
// to backward may be shared or expanded views.
Tensor own_copy(const Tensor& t) { return t.contiguous().clone(); }

Tensor apply1(const std::string& name, const Tensor& x,
              std::function<Tensor(const Tensor&)> forward,
              std::function<Tensor(const Tensor&)> backward) {
  autograd::Function f;
  f.name = name;
  f.forward = [forward](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{forward(in[0])};
  };
  f.backward = [backward](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{backward(g[0])};
  };
  return autograd::apply(f, {x})[0];
}

}  // namespace

Tensor all_reduce(ProcessGroup& g, const Tensor& x, ReduceOp op) {
  if (op != ReduceOp::sum && op != ReduceOp::avg)
    throw std::invalid_argument(
        std::string("[dist::fn::all_reduce] only sum and avg have a gradient, got ") +
        reduce_op_name(op) + " (use ProcessGroup::all_reduce without autograd)");
  ProcessGroup* pg = &g;
  auto run = [pg, op](const Tensor& t) {
    Tensor y = own_copy(t);
    pg->all_reduce(y, op);
    return y;
  };
  // d(sum_s x_s)/dx_r summed over every rank's loss: all_reduce(sum) of the
  // gradients; avg's adjoint is avg.
  return apply1("dist::fn::all_reduce", x, run, run);
}

Tensor all_gather(ProcessGroup& g, const Tensor& x) {
  ProcessGroup* pg = &g;
  const Shape shape = x.shape();
  return apply1(
      "dist::fn::all_gather", x, [pg](const Tensor& t) { return pg->all_gather(t); },
      [pg, shape](const Tensor& grad) {
        return pg->reduce_scatter(own_copy(grad)).reshape(shape);
      });
}

Tensor all_gather_v(ProcessGroup& g, const Tensor& x) {
  ProcessGroup* pg = &g;
  auto sizes = std::make_shared<std::vector<int64_t>>();
  return apply1(
      "dist::fn::all_gather_v", x,
      [pg, sizes](const Tensor& t) { return pg->all_gather_v(t, sizes.get()); },
      [pg, sizes](const Tensor& grad) {
        Tensor total = own_copy(grad);
        pg->all_reduce(total);
        int64_t offset = 0;
        for (int r = 0; r < pg->rank(); ++r) offset += (*sizes)[r];
        return total.narrow(0, offset, (*sizes)[pg->rank()]).clone();
      });
}

Tensor reduce_scatter(ProcessGroup& g, const Tensor& x, ReduceOp op) {
  if (op != ReduceOp::sum && op != ReduceOp::avg)
    throw std::invalid_argument(
        std::string("[dist::fn::reduce_scatter] only sum and avg have a gradient, got ") +
        reduce_op_name(op));
  ProcessGroup* pg = &g;
  return apply1(
      "dist::fn::reduce_scatter", x,
      [pg, op](const Tensor& t) { return pg->reduce_scatter(t, op); },
      [pg, op](const Tensor& grad) {
        Tensor all = pg->all_gather(own_copy(grad));
        return op == ReduceOp::avg ? all / double(pg->size()) : all;
      });
}

Tensor broadcast(ProcessGroup& g, const Tensor& x, int root) {
  ProcessGroup* pg = &g;
  return apply1(
      "dist::fn::broadcast", x,
      [pg, root](const Tensor& t) {
        Tensor y = own_copy(t);
        pg->broadcast(y, root);
        return y;
      },
      [pg, root](const Tensor& grad) {
        Tensor total = own_copy(grad);
        pg->all_reduce(total);  // a reduce to the root; the others drop it
        return pg->rank() == root ? total : zeros_like(total);
      });
}

Tensor global_mean(ProcessGroup& g, const Tensor& sum, const Tensor& count) {
  if (count.numel() != 1)
    throw std::invalid_argument("[dist::fn::global_mean] count must hold one number, got shape " +
                                shape_str(count.shape()));
  // One rank's sums are the global ones: no private copies to reduce.
  const bool alone = g.size() == 1;
  Tensor total = count.detach().reshape({}).to(DType::f64);
  if (!alone) {
    total = total.clone();
    g.all_reduce(total);
  }
  Tensor summed = alone ? sum : all_reduce(g, sum, ReduceOp::sum);
  // The count stays on the device (no host read). No item on any rank means
  // a zero sum: dividing it by 1 keeps it 0.
  const Tensor n = clamp(total, 1.0, std::numeric_limits<double>::quiet_NaN());
  return summed / to_dtype(n, summed.dtype());
}

Tensor global_mean(ProcessGroup& g, const Tensor& sum, int64_t count) {
  if (count < 0)
    throw std::invalid_argument("[dist::fn::global_mean] count must not be negative, got " +
                                std::to_string(count));
  if (g.size() == 1) return sum / double(std::max<int64_t>(count, 1));
  return global_mean(g, sum, scalar(double(count), {.dtype = DType::f64, .device = sum.device()}));
}

}  // namespace quanta::dist::fn
