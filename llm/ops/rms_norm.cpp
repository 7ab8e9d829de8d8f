// rms_norm: checks, the fused kernel pair of llm_kernels(), autograd.
#include "llm/ops/rms_norm.h"

#include <cmath>
#include <memory>

#include "engine/autograd/function.h"
#include "engine/autograd/node.h"
#include "engine/factory.h"
#include "llm/kernels/table.h"
#include "llm/ops/checks.h"

namespace quanta::llm {

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps, RmsWeight how) {
  constexpr const char* op = "rms_norm";
  detail::check_floating(op, "x", x);
  detail::check_floating(op, "weight", weight);
  detail::check_same_dtype(op, "x", x, "weight", weight);
  if (x.dim() < 1) detail::bad_argument(op, "x must have at least one dim, got a 0-d tensor");
  const int64_t n = x.shape().back();
  if (weight.dim() != 1 || weight.size(0) != n)
    detail::bad_argument(op, "weight must be [" + std::to_string(n) + "] (x's last dim), got " +
                                 shape_str(weight.shape()));
  if (!std::isfinite(eps) || eps < 0)
    detail::bad_argument(op, "eps must be finite and >= 0, got " + std::to_string(eps));
  struct Saved {
    Tensor x, weight, inv_rms;
  };
  auto saved = std::make_shared<Saved>();
  // The gradients taken: a frozen weight (a QLoRA model's norms) or an input
  // that needs none (the first norm over frozen embeddings) costs no pass.
  const bool need_x = x.requires_grad(), need_w = weight.requires_grad();
  autograd::Function fn;
  fn.name = op;
  fn.forward = [saved, eps, how](const std::vector<Tensor>& in) {
    const Tensor xc = in[0].contiguous(), wc = in[1].contiguous();
    const LlmKernelTable& k = llm_kernels_for("rms_norm", {&xc, &wc});
    const int64_t rows = detail::leading_rows(xc), cols = xc.shape().back();
    Tensor y = empty(xc.shape(), {.dtype = xc.dtype(), .device = xc.device()});
    Tensor inv = empty({rows}, {.dtype = accumulation_dtype(xc.dtype()), .device = xc.device()});
    k.rms_norm(xc.dtype(), xc.raw_data(), wc.raw_data(), rows, cols, eps, how, y.raw_data(),
               inv.raw_data());
    *saved = Saved{xc, wc, inv};
    return std::vector<Tensor>{y};
  };
  fn.backward = [saved, need_x, need_w, how](const std::vector<Tensor>& g) {
    const Saved& s = *saved;
    const Tensor gy = g[0].to(s.x.dtype()).contiguous();
    const LlmKernelTable& k = llm_kernels_for("rms_norm backward", {&s.x, &gy});
    const int64_t rows = detail::leading_rows(s.x), cols = s.x.shape().back();
    const TensorOptions opts{.dtype = s.x.dtype(), .device = s.x.device()};
    // x's gradient onto the sum of its other gradients (the residual
    // stream's) where the engine hands it over.
    autograd::GradientBuffer gx;
    if (need_x) gx = autograd::gradient_buffer(0, s.x.shape(), s.x.dtype(), s.x.device());
    const Tensor gw = need_w ? empty({cols}, opts) : Tensor();
    k.rms_norm_grad(s.x.dtype(), s.x.raw_data(), s.weight.raw_data(), how, s.inv_rms.raw_data(),
                    gy.raw_data(), rows, cols, need_x ? gx.tensor.raw_data() : nullptr,
                    need_w ? gw.raw_data() : nullptr, gx.add);
    return std::vector<Tensor>{gx.tensor, gw};
  };
  return autograd::apply(fn, {x, weight})[0];
}

}  // namespace quanta::llm
