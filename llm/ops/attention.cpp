// scaled_dot_product_attention: checks, the mask's broadcast view, the
// kernel pair of llm_kernels(), autograd.
#include "llm/ops/attention.h"

#include <cmath>
#include <memory>

#include "engine/autograd/function.h"
#include "engine/factory.h"
#include "engine/kernels/table.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/view.h"
#include "engine/precision.h"
#include "llm/kernels/table.h"
#include "llm/ops/checks.h"

namespace quanta::llm {
namespace {

constexpr const char* kAttentionOp = "scaled_dot_product_attention";

// A [batch, len, heads, dim] operand with its last dim contiguous.
Tensor dim_contiguous(const Tensor& t) {
  return t.numel() == 0 || t.strides()[3] == 1 ? t : t.contiguous();
}

HeadsOperand heads_of(const Tensor& t) {
  return HeadsOperand{t.raw_data(), t.strides()[0], t.strides()[1], t.strides()[2]};
}

// The mask as additive scores of dtype acc, viewed as [B, H, T, S] with
// stride 0 along broadcast dims (a bool mask becomes 0 / -inf).
Tensor additive_mask(const Tensor& mask, const Shape& target, DType acc) {
  if (!mask.defined()) return {};
  Tensor m;
  if (mask.dtype() == DType::boolean) {
    const TensorOptions opts{.dtype = acc, .device = mask.device()};
    m = where(mask, zeros({}, opts), full({}, -INFINITY, opts));
  } else if (is_floating(mask.dtype())) {
    m = mask.to(acc);
  } else {
    detail::bad_argument(kAttentionOp, std::string("mask has dtype ") + dtype_name(mask.dtype()) +
                                           "; expected bool or a floating dtype");
  }
  if (m.dim() > 4)
    detail::bad_argument(kAttentionOp, "mask " + shape_str(mask.shape()) + " has more than 4 dims");
  for (int64_t d = 0; d < m.dim(); ++d) {
    const int64_t size = m.shape()[d], want = target[4 - m.dim() + d];
    if (size != want && size != 1)
      detail::bad_argument(kAttentionOp, "mask " + shape_str(mask.shape()) +
                                             " does not broadcast to " + shape_str(target) +
                                             " [batch, heads, q_len, kv_len]");
  }
  return expand(m, target);
}

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttentionOptions& o) {
  detail::check_floating(kAttentionOp, "q", q);
  detail::check_floating(kAttentionOp, "k", k);
  detail::check_floating(kAttentionOp, "v", v);
  detail::check_same_dtype(kAttentionOp, "q", q, "k", k);
  detail::check_same_dtype(kAttentionOp, "q", q, "v", v);
  const char* layout = "[batch, len, heads, head_dim]";
  detail::check_dims(kAttentionOp, "q", q, 4, layout);
  detail::check_dims(kAttentionOp, "k", k, 4, layout);
  detail::check_dims(kAttentionOp, "v", v, 4, layout);
  if (k.shape() != v.shape())
    detail::bad_argument(
        kAttentionOp, "k " + shape_str(k.shape()) + " and v " + shape_str(v.shape()) + " differ");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t S = k.size(1), Hk = k.size(2);
  if (k.size(0) != B || k.size(3) != D)
    detail::bad_argument(kAttentionOp, "q " + shape_str(q.shape()) + " and k " +
                                           shape_str(k.shape()) + " disagree on batch or head_dim");
  if (Hk == 0 ? H != 0 : H % Hk != 0)
    detail::bad_argument(
        kAttentionOp,
        "q's " + std::to_string(H) + " heads are not a multiple of k's " + std::to_string(Hk));
  const double scale = o.scale ? *o.scale : std::pow(static_cast<double>(D), -0.5);
  if (!std::isfinite(scale)) detail::bad_argument(kAttentionOp, "scale must be finite");
  if (o.window < 0 || (o.window > 0 && !o.causal))
    detail::bad_argument(kAttentionOp, "window must be >= 0 (0: none) and needs causal, got " +
                                           std::to_string(o.window) +
                                           (o.causal ? "" : " without causal"));
  if (!(o.softcap >= 0) || !std::isfinite(o.softcap))
    detail::bad_argument(kAttentionOp, "softcap must be finite and >= 0 (0: none), got " +
                                           std::to_string(o.softcap));
  const DType dt = q.dtype(), acc = accumulation_dtype(dt);
  const Tensor mask = additive_mask(o.mask, {B, H, T, S}, acc);
  if (mask.defined()) common_device(kAttentionOp, {&q, &mask});

  struct Saved {
    Tensor q, k, v, out, lse;
  };
  auto saved = std::make_shared<Saved>();
  const auto args = [=](const Saved& s) {
    AttentionArgs a;
    a.dtype = dt;
    a.batch = B, a.heads = H, a.kv_heads = Hk, a.q_len = T, a.kv_len = S, a.head_dim = D;
    a.scale = scale;
    a.softcap = o.softcap;
    a.window = o.window;
    a.causal = o.causal;
    a.q = heads_of(s.q), a.k = heads_of(s.k), a.v = heads_of(s.v);
    if (mask.defined()) {
      const Shape& st = mask.strides();
      a.mask = MaskOperand{mask.raw_data(), st[0], st[1], st[2], st[3]};
    }
    a.out = s.out.raw_data();
    a.lse = s.lse.raw_data();
    // The forward's precision, and the backward's (its node's, the same).
    a.bf16_products = dt == DType::f32 && mixed_precision_enabled();
    return a;
  };
  autograd::Function fn;
  fn.name = kAttentionOp;
  fn.forward = [=](const std::vector<Tensor>& in) {
    Saved& s = *saved;
    s.q = dim_contiguous(in[0]), s.k = dim_contiguous(in[1]), s.v = dim_contiguous(in[2]);
    const LlmKernelTable& table = llm_kernels_for(kAttentionOp, {&s.q, &s.k, &s.v});
    s.out = empty({B, T, H, D}, {.dtype = dt, .device = s.q.device()});
    s.lse = empty({B, H, T}, {.dtype = acc, .device = s.q.device()});
    table.attention(args(s));
    return std::vector<Tensor>{s.out};
  };
  fn.backward = [=](const std::vector<Tensor>& g) {
    const Saved& s = *saved;
    const Tensor grad = g[0].to(dt).contiguous();
    const LlmKernelTable& table =
        llm_kernels_for("scaled_dot_product_attention backward", {&s.q, &grad});
    const TensorOptions opts{.dtype = dt, .device = s.q.device()};
    Tensor gq = empty({B, T, H, D}, opts), gk = empty({B, S, Hk, D}, opts),
           gv = empty({B, S, Hk, D}, opts);
    Tensor delta = empty({B, H, T}, {.dtype = acc, .device = s.q.device()});
    table.attention_grad(args(s), grad.raw_data(), delta.raw_data(), gq.raw_data(), gk.raw_data(),
                         gv.raw_data());
    return std::vector<Tensor>{gq, gk, gv};
  };
  return autograd::apply(fn, {q, k, v})[0];
}

}  // namespace quanta::llm
