// layer_norm and group_norm: checks, the device's fused kernel pair
// (KernelTable::group_norm, group_norm_grad), autograd.
#include "engine/ops/norm.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/autograd/function.h"
#include "engine/autograd/node.h"
#include "engine/factory.h"
#include "engine/kernels/table.h"
#include "engine/ops/kernel_call.h"
#include "engine/ops/view.h"

namespace quanta {
namespace {

void check_input(const char* op, const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  kernels_for(op, {&x, &w, &b});  // one device for all
  for (const Tensor* t : {&x, &w, &b})
    if (t->defined() && !is_floating(t->dtype()))
      throw std::invalid_argument(std::string("[") + op + "] needs floating " +
                                  (t == &x   ? "input"
                                   : t == &w ? "weight"
                                             : "bias") +
                                  ", got " + dtype_name(t->dtype()));
  if (!std::isfinite(eps) || eps < 0)
    throw std::invalid_argument(std::string("[") + op + "] eps must be finite and >= 0, got " +
                                std::to_string(eps));
}

void check_param(const char* op, const char* what, const Tensor& p, const Shape& want) {
  if (p.defined() && p.shape() != want)
    throw std::invalid_argument(std::string("[") + op + "] " + what + " shape " +
                                shape_str(p.shape()) + " does not match " + shape_str(want));
}

// Where the kernels find x: its contiguous memory, channels first; or, for
// an [N, C, *] view of channels-last memory (stored [N, *, C]: what a
// channels-last convolution's output looks like as [N, C, H, W]), that
// memory as it lies, with no transposing copy either way.
struct NormLayout {
  bool channels_last = false;
  std::vector<int64_t> to_memory, from_memory;  // the permutations, channels last

  static NormLayout of(const Tensor& x, bool may_be_channels_last) {
    NormLayout l;
    if (!may_be_channels_last || x.dim() < 3 || x.is_contiguous()) return l;
    l.to_memory = {0};
    for (int64_t d = 2; d < x.dim(); ++d) l.to_memory.push_back(d);
    l.to_memory.push_back(1);
    if (!permute(x, l.to_memory).is_contiguous()) return NormLayout{};
    l.channels_last = true;
    l.from_memory = {0, x.dim() - 1};
    for (int64_t d = 1; d < x.dim() - 1; ++d) l.from_memory.push_back(d);
    return l;
  }
  // t (x's shape) as the kernels read it: contiguous in this layout, of dtype ct.
  Tensor memory(const Tensor& t, DType ct) const {
    const Tensor v = channels_last ? permute(t, to_memory) : t;
    return detail::as_plain(v, ct).contiguous();
  }
  // Memory in this layout viewed with x's shape.
  Tensor view(const Tensor& mem) const { return channels_last ? permute(mem, from_memory) : mem; }
};

// The fused normalisation of x in geometry g (its layout taken from
// `layout`) with the optional affine parameters (of any shape, read flat as
// [channels]), for layer_norm and group_norm alike.
Tensor normalize(const char* op, const Tensor& x, NormGeom g, const NormLayout& layout,
                 const Tensor& weight, const Tensor& bias, double eps) {
  g.channels_last = layout.channels_last;
  const DType out_dt = x.dtype(), ct = detail::compute_dtype(out_dt);
  std::vector<Tensor> inputs{x};
  const int wi = weight.defined() ? static_cast<int>(inputs.size()) : -1;
  if (weight.defined()) inputs.push_back(weight);
  const int bi = bias.defined() ? static_cast<int>(inputs.size()) : -1;
  if (bias.defined()) inputs.push_back(bias);
  // Each input's shape and dtype: its gradient's.
  std::vector<std::pair<Shape, DType>> kinds;
  for (const Tensor& t : inputs) kinds.emplace_back(t.shape(), t.dtype());
  struct Saved {
    Tensor x, weight, mean, rstd;  // x in its layout; all of ct
  };
  auto saved = std::make_shared<Saved>();
  // The gradients taken: a frozen affine or an input that needs none costs
  // no pass.
  const bool need_x = x.requires_grad();
  const bool need_w = weight.defined() && weight.requires_grad();
  const bool need_b = bias.defined() && bias.requires_grad();
  autograd::Function fn;
  fn.name = op;
  fn.forward = [=](const std::vector<Tensor>& in) {
    const Tensor xm = layout.memory(in[0], ct);
    const Tensor w = wi < 0 ? Tensor() : detail::as_plain(in[wi], ct).contiguous();
    const Tensor b = bi < 0 ? Tensor() : detail::as_plain(in[bi], ct).contiguous();
    const TensorOptions opts{.dtype = ct, .device = xm.device()};
    Tensor y = empty(xm.shape(), opts);
    Tensor mean = empty({g.group_count()}, opts), rstd = empty({g.group_count()}, opts);
    kernels_for(op, {&xm}).group_norm(
        ct, g, eps, xm.raw_data(), w.defined() ? w.raw_data() : nullptr,
        b.defined() ? b.raw_data() : nullptr, y.raw_data(), mean.raw_data(), rstd.raw_data());
    *saved = Saved{xm, w, mean, rstd};
    y = layout.view(y);
    return std::vector<Tensor>{ct == out_dt ? y : detail::as_plain(y, out_dt)};
  };
  fn.backward = [=](const std::vector<Tensor>& grads) {
    const Saved& s = *saved;
    const Tensor gy = layout.memory(grads[0], ct);
    const TensorOptions opts{.dtype = ct, .device = s.x.device()};
    // x's gradient onto the sum of its other gradients where the engine
    // hands it over (same dtype and layout).
    autograd::GradientBuffer gx;
    if (need_x && !layout.channels_last && ct == out_dt)
      gx = autograd::gradient_buffer(0, s.x.shape(), ct, s.x.device());
    else if (need_x)
      gx.tensor = empty(s.x.shape(), opts);
    const Tensor gw = need_w ? empty({g.channels}, opts) : Tensor();
    const Tensor gb = need_b ? empty({g.channels}, opts) : Tensor();
    kernels_for(op, {&s.x, &gy})
        .group_norm_grad(ct, g, s.x.raw_data(), s.weight.defined() ? s.weight.raw_data() : nullptr,
                         s.mean.raw_data(), s.rstd.raw_data(), gy.raw_data(),
                         need_x ? gx.tensor.raw_data() : nullptr, need_w ? gw.raw_data() : nullptr,
                         need_b ? gb.raw_data() : nullptr, gx.add);
    std::vector<Tensor> out(kinds.size());
    if (need_x) {
      out[0] = layout.view(gx.tensor);
      if (ct != out_dt) out[0] = detail::as_plain(out[0], out_dt);
    }
    // A parameter's gradient in its own shape and dtype.
    const auto param_grad = [&](int i, const Tensor& gp) {
      out[i] = detail::as_plain(reshape(gp, kinds[i].first), kinds[i].second);
    };
    if (need_w) param_grad(wi, gw);
    if (need_b) param_grad(bi, gb);
    return out;
  };
  return autograd::apply(fn, inputs)[0];
}

}  // namespace

Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight,
                  const Tensor& bias, double eps) {
  check_input("layer_norm", x, weight, bias, eps);
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  const Shape trailing(x.shape().end() - std::min<int64_t>(k, x.dim()), x.shape().end());
  if (k == 0 || k > x.dim() || trailing != normalized_shape)
    throw std::invalid_argument("[layer_norm] normalized_shape " + shape_str(normalized_shape) +
                                " must be non-empty and match the trailing dims of input "
                                "shape " +
                                shape_str(x.shape()));
  check_param("layer_norm", "weight", weight, normalized_shape);
  check_param("layer_norm", "bias", bias, normalized_shape);
  int64_t n = 1;
  for (const int64_t v : normalized_shape) n *= v;
  const NormGeom g{.batch = n == 0 ? 0 : x.numel() / n, .channels = n, .spatial = 1, .groups = 1};
  return normalize("layer_norm", x, g, NormLayout{}, weight, bias, eps);
}

Tensor group_norm(const Tensor& x, int64_t num_groups, const Tensor& weight, const Tensor& bias,
                  double eps) {
  check_input("group_norm", x, weight, bias, eps);
  if (x.dim() < 2)
    throw std::invalid_argument("[group_norm] input must be [N, C, *], got shape " +
                                shape_str(x.shape()));
  const int64_t n = x.shape()[0], c = x.shape()[1];
  if (num_groups <= 0 || c % num_groups != 0)
    throw std::invalid_argument("[group_norm] num_groups " + std::to_string(num_groups) +
                                " must be positive and divide the " + std::to_string(c) +
                                " channels");
  check_param("group_norm", "weight", weight, {c});
  check_param("group_norm", "bias", bias, {c});
  int64_t spatial = 1;
  for (int64_t d = 2; d < x.dim(); ++d) spatial *= x.shape()[d];
  const NormGeom g{.batch = n, .channels = c, .spatial = spatial, .groups = num_groups};
  return normalize("group_norm", x, g, NormLayout::of(x, /*may_be_channels_last=*/true), weight,
                   bias, eps);
}

}  // namespace quanta
