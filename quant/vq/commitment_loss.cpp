#include "quant/vq/commitment_loss.h"

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/autograd/function.h"
#include "engine/dispatch.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/view.h"
#include "quant/kernels/table.h"

namespace quanta::quant {

namespace {

const uint8_t* mask_data(const Tensor& mask) {
  return mask.defined() ? static_cast<const uint8_t*>(mask.raw_data()) : nullptr;
}

}  // namespace

Tensor row_mask(const Tensor& valid, int64_t rows) {
  if (!valid.defined()) return Tensor();
  if (valid.numel() != rows)
    throw std::invalid_argument("[commitment_loss] valid has " + std::to_string(valid.numel()) +
                                " entries for " + std::to_string(rows) + " tokens");
  return contiguous(valid.detach().to(DType::u8));
}

Tensor SquaredError::mean(DType dtype) const {
  dispatch_float(dtype, "commitment_loss", [](auto) {});  // f32 or f64
  Tensor out = empty({}, {.dtype = dtype, .device = sums.device()});
  quant_kernels(sums.device())
      .squared_error_mean(dtype, static_cast<const double*>(sums.raw_data()), out.raw_data());
  return out;
}

Tensor SquaredError::coefficient(const Tensor& g, double scale) const {
  if (g.numel() != 1)
    throw std::invalid_argument("[commitment_loss] the loss's gradient must be one number, got " +
                                shape_str(g.shape()));
  // f32 and f64 are read as they are; another dtype is widened first.
  const Tensor gv =
      g.dtype() == DType::f32 || g.dtype() == DType::f64 ? contiguous(g) : to_dtype(g, DType::f64);
  const QuantKernelTable& kernels = quant_kernels_for("commitment_loss backward", {&gv, &sums});
  Tensor out = empty({1}, {.dtype = DType::f64, .device = sums.device()});
  kernels.squared_error_coefficient(gv.dtype(), gv.raw_data(), scale,
                                    static_cast<const double*>(sums.raw_data()),
                                    static_cast<double*>(out.raw_data()));
  return out;
}

SquaredError masked_squared_error(const Tensor& x, const Tensor& q, const Tensor& valid) {
  const QuantKernelTable& kernels = quant_kernels_for("commitment_loss", {&x, &q, &valid});
  const Tensor xc = contiguous(x.detach()), qc = contiguous(q.detach());
  const int64_t d = xc.size(-1);
  const int64_t rows = d == 0 ? 0 : xc.numel() / d;
  dispatch_float(xc.dtype(), "commitment_loss", [](auto) {});  // f32 or f64
  const Tensor mask = row_mask(valid, rows);
  SquaredError e{empty({2}, {.dtype = DType::f64, .device = xc.device()})};
  kernels.squared_error(xc.dtype(), xc.raw_data(), qc.raw_data(), mask_data(mask), rows, d,
                        static_cast<double*>(e.sums.raw_data()));
  return e;
}

Tensor commitment_loss(const Tensor& x, const Tensor& q, const Tensor& valid) {
  const QuantKernelTable& kernels = quant_kernels_for("commitment_loss", {&x, &q, &valid});
  if (x.shape() != q.shape() || x.dtype() != q.dtype() || x.dim() < 1)
    throw std::invalid_argument("[commitment_loss] x and q must share shape and dtype, got " +
                                shape_str(x.shape()) + " and " + shape_str(q.shape()));
  const int64_t d = x.size(-1);
  const int64_t rows = d == 0 ? 0 : x.numel() / d;
  autograd::Function fn;
  fn.name = "commitment_loss";
  // The sum and count * d, shared by forward and backward.
  auto error = std::make_shared<SquaredError>();
  fn.forward = [=](const std::vector<Tensor>& in) {
    *error = masked_squared_error(in[0], in[1], valid);
    return std::vector<Tensor>{error->mean(in[0].dtype())};
  };
  const bool q_grad = q.requires_grad();
  fn.backward = [=, &kernels, xs = x.detach(), qs = q.detach()](const std::vector<Tensor>& grads) {
    const Tensor xc = contiguous(xs), qc = contiguous(qs);
    // Uninitialised: every element is written below (0 for masked rows).
    Tensor gx = empty(xs.shape(), options_of(xs));
    const Tensor scale = error->coefficient(grads[0], 2.0);
    const Tensor mask = row_mask(valid, rows);
    kernels.squared_error_grad(xc.dtype(), xc.raw_data(), qc.raw_data(), mask_data(mask), rows, d,
                               static_cast<const double*>(scale.raw_data()), gx.raw_data());
    return std::vector<Tensor>{gx, q_grad ? -gx : Tensor()};
  };
  return autograd::apply(fn, {x, q})[0];
}

}  // namespace quanta::quant
