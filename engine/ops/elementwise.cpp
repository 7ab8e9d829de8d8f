// Binary arithmetic, comparisons, where, in-place updates and operators.
#include "engine/ops/elementwise.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "engine/autograd/node.h"
#include "engine/cpu/parallel.h"
#include "engine/device_backend.h"
#include "engine/dispatch.h"
#include "engine/factory.h"
#include "engine/ops/kernel_call.h"
#include "engine/ops/reduce.h"

namespace quanta {
namespace {

using detail::binary_kernel;

// What an input's gradient needs of the input itself: its shape (to sum a
// broadcast away) and dtype. Backward closures keep this, not the tensor,
// where they do not read its values: a kept tensor is memory held until the
// backward pass (a decoder's adds kept every base output and LoRA term,
// ~1.7 GB of a 110M model's QLoRA step).
struct InputMeta {
  Shape shape;
  DType dtype;
};

InputMeta meta_of_input(const Tensor& t) { return {t.shape(), t.dtype()}; }

// The gradient for input `in` from a broadcast output gradient.
Tensor grad_for(const Tensor& g, const InputMeta& in) {
  return to_dtype(sum_to(g, in.shape), in.dtype);
}
Tensor grad_for(const Tensor& g, const Tensor& in) { return grad_for(g, meta_of_input(in)); }

// `t` detached when a backward reads its values (`needed`), else nothing.
Tensor kept_if(bool needed, const Tensor& t) { return needed ? t.detach() : Tensor(); }

// Arithmetic result: promoted dtype (16-bit floats computed in f32, stored back).
Tensor arith(BinaryOp op, const Tensor& a, const Tensor& b) {
  check_arithmetic(op_name(op), {a.dtype(), b.dtype()});
  const DType out_dt = promote_types(a.dtype(), b.dtype());
  Tensor out = binary_kernel(op, a, b, out_dt == DType::boolean ? DType::u8 : out_dt);
  return out.dtype() == out_dt ? out : detail::as_plain(out, out_dt);
}

Tensor compare(BinaryOp op, const Tensor& a, const Tensor& b) {
  check_arithmetic(op_name(op), {a.dtype(), b.dtype()});
  const DType t = promote_types(a.dtype(), b.dtype());
  return binary_kernel(op, a, b, t == DType::boolean ? DType::u8 : t);
}

std::vector<Tensor> two(Tensor a, Tensor b) { return {std::move(a), std::move(b)}; }

// An input's gradient only when it takes one (requires_grad when the op was
// recorded): undefined means zero to the engine, and skipping it saves a
// full pass, e.g. x - c.detach() or x * w with a constant w.
template <class F>
Tensor if_needed(bool needed, F&& grad) {
  return needed ? grad() : Tensor();
}

}  // namespace

namespace {
// The dtype `x` computes with the scalar v in: x's own, f32 for a fraction
// beside integers, for any value beside bool, and for a byte-only dtype such
// as nf4 (which the op using it then reports).
DType scalar_dtype_like(const Tensor& x, double v) {
  const DType t = x.dtype();
  if (!dtype_info(t).arithmetic) return DType::f32;
  if (!is_floating(t) && (std::floor(v) != v || t == DType::boolean)) return DType::f32;
  return t;
}
}  // namespace

Tensor scalar_like(const Tensor& x, double v) {
  return scalar(v, {.dtype = scalar_dtype_like(x, v), .device = x.device()});
}

Tensor constant_like(const Tensor& x, double v) {
  return shared_full({}, v, {.dtype = scalar_dtype_like(x, v), .device = x.device()});
}

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor out = arith(BinaryOp::add, a, b);
  return autograd::record("add", out, {a, b},
                          [a = meta_of_input(a), b = meta_of_input(b), na = a.requires_grad(),
                           nb = b.requires_grad()](const Tensor& g) {
                            return two(if_needed(na, [&] { return grad_for(g, a); }),
                                       if_needed(nb, [&] { return grad_for(g, b); }));
                          });
}

Tensor sub(const Tensor& a, const Tensor& b) {
  Tensor out = arith(BinaryOp::sub, a, b);
  return autograd::record("sub", out, {a, b},
                          [a = meta_of_input(a), b = meta_of_input(b), na = a.requires_grad(),
                           nb = b.requires_grad()](const Tensor& g) {
                            return two(if_needed(na, [&] { return grad_for(g, a); }),
                                       if_needed(nb, [&] { return grad_for(neg(g), b); }));
                          });
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = arith(BinaryOp::mul, a, b);
  // a's gradient reads b and b's reads a: each is kept only for the other.
  const bool na = a.requires_grad(), nb = b.requires_grad();
  return autograd::record("mul", out, {a, b},
                          [a = kept_if(nb, a), b = kept_if(na, b), ma = meta_of_input(a),
                           mb = meta_of_input(b), na, nb](const Tensor& g) {
                            return two(if_needed(na, [&] { return grad_for(mul(g, b), ma); }),
                                       if_needed(nb, [&] { return grad_for(mul(g, a), mb); }));
                          });
}

Tensor div(const Tensor& a, const Tensor& b) {
  // True division: integers divide as floats, like torch.div.
  const DType out_dt = to_floating(promote_types(a.dtype(), b.dtype()));
  Tensor out = binary_kernel(BinaryOp::div, a, b, out_dt);
  if (out.dtype() != out_dt) out = detail::as_plain(out, out_dt);
  return autograd::record(
      "div", out, {a, b},
      [a = meta_of_input(a), b = b.detach(), o = kept_if(b.requires_grad(), out),
       na = a.requires_grad(), nb = b.requires_grad()](const Tensor& g) {
        return two(if_needed(na, [&] { return grad_for(div(g, b), a); }),
                   if_needed(nb, [&] { return grad_for(neg(div(mul(g, o), b)), b); }));
      });
}

Tensor add_n(const std::vector<Tensor>& terms) {
  if (terms.empty()) throw std::invalid_argument("[add_n] needs at least one term");
  const Tensor& first = terms[0];
  // Three or more like terms: one kernel adding them in order (the bits of
  // the chain of adds below, without its temporaries).
  bool fused = terms.size() > 2 && (first.dtype() == DType::f32 || first.dtype() == DType::f64);
  for (const Tensor& t : terms)
    fused = fused && t.defined() && t.device() == first.device() && t.dtype() == first.dtype() &&
            t.shape() == first.shape();
  if (!fused) {
    Tensor total = first;
    for (std::size_t i = 1; i < terms.size(); ++i) total = add(total, terms[i]);
    return total;
  }
  std::vector<Tensor> in;
  std::vector<const void*> data;
  for (const Tensor& t : terms) {
    in.push_back(contiguous(t.detach()));
    data.push_back(in.back().raw_data());
  }
  Tensor out = detail::make_tensor(first.shape(), first.dtype(), first.device());
  kernels(first.device())
      .add_n(first.dtype(), {data.data(), static_cast<int64_t>(data.size())}, out.numel(),
             out.raw_data());
  std::vector<bool> needs;
  for (const Tensor& t : terms) needs.push_back(t.requires_grad());
  return autograd::record("add_n", out, terms, [needs](const Tensor& g) {
    std::vector<Tensor> grads;
    for (bool n : needs) grads.push_back(n ? g : Tensor());
    return grads;
  });
}

Tensor pow(const Tensor& a, const Tensor& b) {
  const DType out_dt = to_floating(promote_types(a.dtype(), b.dtype()));
  Tensor out = binary_kernel(BinaryOp::pow, a, b, out_dt);
  if (out.dtype() != out_dt) out = detail::as_plain(out, out_dt);
  return autograd::record(
      "pow", out, {a, b}, [a = a.detach(), b = b.detach(), o = out.detach()](const Tensor& g) {
        Tensor ga = mul(g, mul(b, pow(a, sub(b, constant_like(b, 1.0)))));
        // d/db a^b = a^b log a, taken as 0 where a == 0 and b >= 0 (the limit).
        Tensor zero_base = logical_and(eq(a, constant_like(a, 0.0)), ge(b, constant_like(b, 0.0)));
        Tensor gb = where(zero_base, constant_like(o, 0.0), mul(g, mul(o, log(a))));
        return two(grad_for(ga, a), grad_for(gb, b));
      });
}

Tensor pow(const Tensor& a, double p) {
  Tensor out;
  if (p == 2.0) {
    out = detail::unary_float(UnaryOp::square, a);
  } else {
    out = detail::unary_float(UnaryOp::pow_scalar, a, {p});
  }
  return autograd::record("pow", out, {a}, [a = a.detach(), p](const Tensor& g) {
    if (p == 0.0) return std::vector<Tensor>{zeros_like(g)};
    return std::vector<Tensor>{mul(g, mul(constant_like(g, p), pow(a, p - 1.0)))};
  });
}

Tensor maximum(const Tensor& a, const Tensor& b) {
  Tensor out = arith(BinaryOp::maximum, a, b);
  return autograd::record("maximum", out, {a, b},
                          [a = a.detach(), b = b.detach()](const Tensor& g) {
                            Tensor half = mul(g, constant_like(g, 0.5));
                            Tensor tie = eq(a, b);
                            Tensor ga = where(tie, half, where(gt(a, b), g, constant_like(g, 0.0)));
                            Tensor gb = where(tie, half, where(lt(a, b), g, constant_like(g, 0.0)));
                            return two(grad_for(ga, a), grad_for(gb, b));
                          });
}

Tensor relu_backward(const Tensor& grad, const Tensor& x) {
  Tensor out = arith(BinaryOp::relu_backward, grad, x);
  return autograd::record("relu_backward", out, {grad, x},
                          [x = x.detach(), g0 = grad.detach()](const Tensor& g) {
                            return two(grad_for(relu_backward(g, x), g0), Tensor());
                          });
}

Tensor minimum(const Tensor& a, const Tensor& b) {
  Tensor out = arith(BinaryOp::minimum, a, b);
  return autograd::record("minimum", out, {a, b},
                          [a = a.detach(), b = b.detach()](const Tensor& g) {
                            Tensor half = mul(g, constant_like(g, 0.5));
                            Tensor tie = eq(a, b);
                            Tensor ga = where(tie, half, where(lt(a, b), g, constant_like(g, 0.0)));
                            Tensor gb = where(tie, half, where(gt(a, b), g, constant_like(g, 0.0)));
                            return two(grad_for(ga, a), grad_for(gb, b));
                          });
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  const KernelTable& k = kernels_for("where", {&cond, &a, &b});
  if (cond.dtype() != DType::boolean)
    throw std::invalid_argument(std::string("[where] condition must be bool, got ") +
                                dtype_name(cond.dtype()));
  const Shape shape =
      broadcast_shapes(cond.shape(), broadcast_shapes(a.shape(), b.shape(), "where"), "where");
  const DType out_dt = promote_types(a.dtype(), b.dtype());
  Tensor c = expand(cond.detach(), shape);
  Tensor ea = expand(detail::as_plain(a, out_dt), shape);
  Tensor eb = expand(detail::as_plain(b, out_dt), shape);
  Tensor out = detail::make_tensor(shape, out_dt, a.device());
  k.where(shape, operand_of(out), operand_of(c), operand_of(ea), operand_of(eb));
  return autograd::record(
      "where", out, {a, b},
      [c = cond.detach(), a = meta_of_input(a), b = meta_of_input(b)](const Tensor& g) {
        Tensor z = constant_like(g, 0.0);
        return two(grad_for(where(c, g, z), a), grad_for(where(c, z, g), b));
      });
}

// ---- comparisons and logic (nd) ----
Tensor eq(const Tensor& a, const Tensor& b) { return compare(BinaryOp::eq, a, b); }
Tensor ne(const Tensor& a, const Tensor& b) { return compare(BinaryOp::ne, a, b); }
Tensor lt(const Tensor& a, const Tensor& b) { return compare(BinaryOp::lt, a, b); }
Tensor le(const Tensor& a, const Tensor& b) { return compare(BinaryOp::le, a, b); }
Tensor gt(const Tensor& a, const Tensor& b) { return compare(BinaryOp::gt, a, b); }
Tensor ge(const Tensor& a, const Tensor& b) { return compare(BinaryOp::ge, a, b); }

namespace {
// The kernels take u8 operands (the functors test != 0): a bool tensor's
// bytes are read as they are, with no converting copy.
Tensor logical_operand(const Tensor& x) {
  const Tensor b = x.dtype() == DType::boolean ? x.detach() : detail::as_plain(x, DType::boolean);
  return detail::same_bytes_as(b, DType::u8);
}

Tensor logical(BinaryOp op, const Tensor& a, const Tensor& b) {
  return binary_kernel(op, logical_operand(a), logical_operand(b), DType::u8);
}
}  // namespace

Tensor logical_and(const Tensor& a, const Tensor& b) {
  return logical(BinaryOp::logical_and, a, b);
}
Tensor logical_or(const Tensor& a, const Tensor& b) { return logical(BinaryOp::logical_or, a, b); }
Tensor logical_xor(const Tensor& a, const Tensor& b) {
  return logical(BinaryOp::logical_xor, a, b);
}
Tensor logical_not(const Tensor& x) {
  return eq(detail::as_plain(x, DType::boolean),
            shared_full({}, 0.0, {.dtype = DType::boolean, .device = x.device()}));
}

Tensor straight_through(const Tensor& x, const Tensor& q) { return add(x, sub(q, x).detach()); }

// ---- in place ----
namespace detail {
void check_inplace(const char* op, const Tensor& dst);
}

namespace {
void update(UpdateOp op, const char* name, const Tensor& dst, ScalarArgs args, const Tensor& a,
            const Tensor& b) {
  detail::check_inplace(name, dst);
  const KernelTable& k = kernels_for(name, {&dst, &a, &b});
  const DType t = dst.dtype();
  const DType ct = detail::elementwise_dtype(k, t, {&dst, &a, &b});
  if (ct != t) {  // 16-bit floats the device does not take: compute in f32, store back
    Tensor tmp = detail::as_plain(dst, ct);
    update(op, name, tmp, args, a, b);
    copy_(dst, tmp);
    return;
  }
  Tensor ea = expand(detail::as_plain(a, t), dst.shape());
  Tensor eb = expand(detail::as_plain(b, t), dst.shape());
  k.update(op, args, dst.shape(), operand_of(dst), operand_of(ea), operand_of(eb));
}
}  // namespace

void add_(const Tensor& dst, const Tensor& src, double alpha) {
  update(UpdateOp::add_scaled, "add_", dst, {alpha}, src, src);
}
void mul_(const Tensor& dst, const Tensor& src) {
  update(UpdateOp::mul, "mul_", dst, {}, src, src);
}
void mul_(const Tensor& dst, double v) { mul_(dst, constant_like(dst, v)); }
void div_(const Tensor& dst, const Tensor& src) {
  update(UpdateOp::div, "div_", dst, {}, src, src);
}
void addcmul_(const Tensor& dst, const Tensor& a, const Tensor& b, double alpha) {
  update(UpdateOp::addcmul, "addcmul_", dst, {alpha}, a, b);
}
void addcdiv_(const Tensor& dst, const Tensor& a, const Tensor& b, double alpha) {
  update(UpdateOp::addcdiv, "addcdiv_", dst, {alpha}, a, b);
}

// ---- operators ----
Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator-(const Tensor& a) { return neg(a); }
Tensor operator+(const Tensor& a, double b) { return add(a, constant_like(a, b)); }
Tensor operator-(const Tensor& a, double b) { return sub(a, constant_like(a, b)); }
Tensor operator*(const Tensor& a, double b) { return mul(a, constant_like(a, b)); }
Tensor operator/(const Tensor& a, double b) { return div(a, constant_like(a, b)); }
Tensor operator+(double a, const Tensor& b) { return add(constant_like(b, a), b); }
Tensor operator-(double a, const Tensor& b) { return sub(constant_like(b, a), b); }
Tensor operator*(double a, const Tensor& b) { return mul(constant_like(b, a), b); }
Tensor operator/(double a, const Tensor& b) { return div(constant_like(b, a), b); }

}  // namespace quanta
