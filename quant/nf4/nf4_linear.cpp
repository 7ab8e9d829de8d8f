#include "quant/nf4/nf4_linear.h"

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/autograd/grad_mode.h"
#include "engine/autograd/node.h"
#include "engine/factory.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "engine/shared_bf16_input.h"
#include "quant/kernels/table.h"
#include "quant/nf4/nf4_format.h"
#include "quant/nf4/nf4_runs.h"

namespace quanta::quant {
namespace {

using detail::NF4Runs;

// The weight as the kernels see it, kept alive by backward: the nf4 tensor,
// or bitsandbytes' packed codes with their f32 scales. Detached handles of
// their own: a layer whose storage is swapped after the forward (a sharded
// base, freed once the layer ran) leaves what backward reads intact.
struct Weight {
  Tensor nf4;
  Tensor packed, scales;
  int64_t block = kNF4UnitElems;
  int64_t n_out = 0, n_in = 0;

  NF4Runs runs() const {
    if (nf4.defined()) return detail::unit_runs(nf4);
    return detail::packed_runs(static_cast<const uint8_t*>(packed.raw_data()),
                               static_cast<const float*>(scales.raw_data()), n_out * n_in, block);
  }
};

void check_args(const Tensor& x, const Shape& w_shape, const Tensor& bias, DType dd) {
  if (w_shape.size() != 2)
    throw std::invalid_argument("[nf4_linear] weight must be 2-d [out, in], got shape " +
                                shape_str(w_shape));
  if (!x.defined() || x.dim() < 1 || x.size(-1) != w_shape[1])
    throw std::invalid_argument(
        "[nf4_linear] input's last dim must be in = " + std::to_string(w_shape[1]) +
        ", got shape " + (x.defined() ? shape_str(x.shape()) : "undefined"));
  if (x.dtype() != DType::f32 && x.dtype() != DType::f64)
    throw std::invalid_argument(std::string("[nf4_linear] input dtype must be f32 or f64, got ") +
                                dtype_name(x.dtype()));
  if (bias.defined() && (bias.shape() != Shape{w_shape[0]} || bias.dtype() != x.dtype()))
    throw std::invalid_argument("[nf4_linear] bias must be [" + std::to_string(w_shape[0]) +
                                "] of the input's dtype, got " + shape_str(bias.shape()) + " " +
                                dtype_name(bias.dtype()));
  detail::check_dequant_dtype(dd, "nf4_linear");
}

Tensor linear_impl(const Tensor& x, std::shared_ptr<const Weight> w, const Tensor& bias, DType dd) {
  const QuantKernelTable& kernels = quant_kernels(x.device());
  const int64_t K = w->n_in, N = w->n_out;
  const int64_t M = numel_of(Shape(x.shape().begin(), x.shape().end() - 1));
  Shape out_shape = x.shape();
  out_shape.back() = N;
  const Tensor xc = x.detach().contiguous();
  const Tensor bc = bias.defined() ? bias.detach().contiguous() : Tensor();
  // x's rounding shared with the other products of x (SharedBf16Input),
  // where the weight computes in bf16: the first writes it.
  Bf16Input xb;
  if (dd == DType::bf16)
    if (quanta::detail::SharedBf16Slot* slot = quanta::detail::shared_bf16_input(x)) {
      xb.data = slot->rounded.raw_data();
      xb.write = !slot->written;
      slot->written = true;
    }
  // An output nobody reads (a module call inside UnreadOutputGuard) is not
  // computed: the backward reads only x's shape and the weight. Unless the
  // product writes a rounding of x that other products share.
  Tensor y;
  if (output_unread() && !xb.write) {
    y = zeros(out_shape, {.dtype = x.dtype(), .device = x.device()});
  } else {
    y = quanta::detail::make_tensor(out_shape, x.dtype(), x.device());
    kernels.nf4_linear(x.dtype(), xc.raw_data(), M, K, w->runs(), dd, N,
                       bc.defined() ? bc.raw_data() : nullptr, y.raw_data(), xb);
  }
  std::vector<Tensor> inputs{x};
  if (bias.defined()) inputs.push_back(bias);
  // Backward keeps only the packed weight and its scales.
  return autograd::record(
      "nf4_linear", y, inputs,
      [&kernels, w, dd, x_shape = x.shape(), has_bias = bias.defined(), M, N, K](const Tensor& g) {
        const Tensor gc = g.contiguous();
        // Onto the sum of x's other gradients where the engine hands it over.
        const autograd::GradientBuffer dx =
            autograd::gradient_buffer(0, x_shape, g.dtype(), gc.device());
        kernels.nf4_linear_grad(g.dtype(), gc.raw_data(), M, N, w->runs(), dd, K,
                                dx.tensor.raw_data(), dx.add);
        std::vector<Tensor> grads{dx.tensor};
        if (has_bias) grads.push_back(sum(gc.reshape({M, N}), {0}));
        return grads;
      });
}

}  // namespace

Tensor nf4_linear(const Tensor& x, const Tensor& w, const Tensor& bias, DType dequant_dtype) {
  check_nf4(w, "nf4_linear");
  check_args(x, w.shape(), bias, dequant_dtype);
  quant_kernels_for("nf4_linear", {&x, &w, &bias});
  auto weight = std::make_shared<Weight>();
  weight->nf4 = w.detach();
  weight->n_out = w.size(0);
  weight->n_in = w.size(1);
  return linear_impl(x, std::move(weight), bias, dequant_dtype);
}

Tensor nf4_linear(const Tensor& x, const BnbNF4State& w, const Tensor& bias, DType dequant_dtype) {
  // The state's scales are rebuilt on the host (interop), then move to x.
  return detail::nf4_linear_scaled(x, w.packed, bnb_scales(w).to(x.device()), w.blocksize, w.shape,
                                   bias, dequant_dtype);
}

namespace detail {

Tensor nf4_linear_scaled(const Tensor& x, const Tensor& packed, const Tensor& scales, int64_t block,
                         const Shape& shape, const Tensor& bias, DType dequant_dtype) {
  check_args(x, shape, bias, dequant_dtype);
  if (!scales.defined() || scales.dtype() != DType::f32)
    throw std::invalid_argument("[nf4_linear] scales must be f32");
  quant_kernels_for("nf4_linear", {&x, &bias, &scales});
  auto weight = std::make_shared<Weight>();
  weight->scales = scales.detach().contiguous();
  weight->packed = packed.detach().to(x.device()).to(DType::u8).contiguous();
  weight->block = block;
  weight->n_out = shape[0];
  weight->n_in = shape[1];
  return linear_impl(x, std::move(weight), bias, dequant_dtype);
}

}  // namespace detail

}  // namespace quanta::quant
