#include "quant/vq/rotation_trick.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "engine/autograd/function.h"
#include "engine/factory.h"
#include "engine/ops/view.h"
#include "quant/kernels/table.h"
#include "quant/vq/commitment_loss.h"

namespace quanta::quant {
namespace {

void check_pair(const char* op, const Tensor& x, const Tensor& q) {
  quant_kernels_for(op, {&x, &q});
  if (x.shape() != q.shape() || x.dim() < 1)
    throw std::invalid_argument(std::string("[") + op + "] x and q must have the same shape, got " +
                                shape_str(x.shape()) + " and " + shape_str(q.shape()));
  if (x.dtype() != q.dtype())
    throw std::invalid_argument(std::string("[") + op + "] x and q must share a dtype, got " +
                                dtype_name(x.dtype()) + " and " + dtype_name(q.dtype()));
}

// x's gradient from the output gradient `g` along `route`, plus the
// commitment term (coef: one f64 on the device; undefined: none) over the
// rows `mask` (u8, undefined: all).
Tensor input_gradient(const Tensor& xs, const Tensor& qd, const Tensor& g_out, GradientRoute route,
                      const Tensor& coef, const Tensor& mask) {
  const QuantKernelTable& kernels = quant_kernels(xs.device());
  const int64_t d = xs.size(-1);
  const int64_t rows = d == 0 ? 0 : xs.numel() / d;
  const Tensor xc = contiguous(xs), qc = contiguous(qd),
               g = contiguous(to_dtype(g_out, xs.dtype()));
  Tensor gx = empty(xs.shape(), options_of(xs));  // every element is written
  const auto* valid =
      coef.defined() && mask.defined() ? static_cast<const uint8_t*>(mask.raw_data()) : nullptr;
  kernels.route_grad(route == GradientRoute::rotation, xs.dtype(), xc.raw_data(), qc.raw_data(),
                     g.raw_data(), valid,
                     coef.defined() ? static_cast<const double*>(coef.raw_data()) : nullptr, rows,
                     d, gx.raw_data());
  return gx;
}

}  // namespace

Tensor rotate_to(const Tensor& x, const Tensor& q) {
  check_pair("rotate_to", x, q);
  const Tensor qd = q.detach();
  autograd::Function fn;
  fn.name = "rotate_to";
  // The value is q itself: R x = lambda |x| q^ = q, without the rounding of
  // evaluating the rotation (apply() hands out a fresh handle).
  fn.forward = [](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[1]}; };
  fn.backward = [xs = x.detach(), qd](const std::vector<Tensor>& grads) {
    return std::vector<Tensor>{
        input_gradient(xs, qd, grads[0], GradientRoute::rotation, Tensor(), Tensor()), Tensor()};
  };
  return autograd::apply(fn, {x, qd})[0];
}

TrainingOutput route_with_commitment(const Tensor& x, const Tensor& q, const Tensor& valid,
                                     GradientRoute route) {
  check_pair("route_with_commitment", x, q);
  quant_kernels_for("route_with_commitment", {&x, &valid});
  const int64_t d = x.size(-1);
  const Tensor mask = row_mask(valid, d == 0 ? 0 : x.numel() / d);
  const Tensor qd = q.detach();
  auto error = std::make_shared<SquaredError>();  // the commitment's sum and count
  autograd::Function fn;
  fn.name = route == GradientRoute::rotation ? "rotate_with_commitment"
                                             : "straight_through_with_commitment";
  fn.forward = [=](const std::vector<Tensor>& in) {
    *error = masked_squared_error(in[0], in[1], mask);
    return std::vector<Tensor>{in[1], error->mean(in[0].dtype())};
  };
  fn.backward = [=, xs = x.detach()](const std::vector<Tensor>& grads) {
    const Tensor coef = error->coefficient(grads[1], 2.0);
    return std::vector<Tensor>{input_gradient(xs, qd, grads[0], route, coef, mask), Tensor()};
  };
  const std::vector<Tensor> out = autograd::apply(fn, {x, qd});
  return {out[0], out[1]};
}

}  // namespace quanta::quant
