#include "quant/vq/commitment_loss.h"

#include <limits>
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

namespace {
// The element count, at least 1: a count of 0 comes with a sum of 0.
Tensor elements_at_least_one(const Tensor& sums) {
  return clamp(slice(sums, 0, 1, 2), 1.0, std::numeric_limits<double>::quiet_NaN());
}
}  // namespace

Tensor SquaredError::mean(DType dtype) const {
  return reshape(to_dtype(slice(sums, 0, 0, 1) / elements_at_least_one(sums), dtype), {});
}

Tensor SquaredError::coefficient(const Tensor& g, double scale) const {
  // The order of the host formula it replaces, g * scale / n, in f64.
  return reshape(to_dtype(g, DType::f64) * scale, {1}) / elements_at_least_one(sums);
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
