// Matrix products: matmul, linear, bmm, outer, sq_dist. Forward through the
// device's GEMM entry (Eigen on the CPU, cuBLAS on CUDA); backward formulas
// are matmuls.
#include "engine/ops/linalg.h"

#include <algorithm>
#include <string>

#include "engine/autograd/node.h"
#include "engine/dispatch.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/kernel_call.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "engine/precision.h"

namespace quanta {
namespace {

std::string shapes_str(const Tensor& a, const Tensor& b) {
  return shape_str(a.shape()) + " and " + shape_str(b.shape());
}

// The floating dtype a product of `a` and `b` is computed and returned in.
DType product_dtype(const char* op, const Tensor& a, const Tensor& b) {
  check_arithmetic(op, {a.dtype(), b.dtype()});
  const DType dt = promote_types(a.dtype(), b.dtype());
  if (!is_floating(dt))
    throw std::invalid_argument(std::string("[") + op + "] needs floating operands: got " +
                                dtype_name(a.dtype()) + " and " + dtype_name(b.dtype()) +
                                "; cast them to f32 or f64 first");
  return dt;
}

Tensor cast(const Tensor& x, DType dt) { return x.dtype() == dt ? x : to_dtype(x, dt); }

// The dtype `k`'s GEMM runs a product of dtype `dt` in: 16-bit floats stay
// 16-bit where the device multiplies them directly (f32 accumulation either
// way), else they widen to f32.
DType gemm_dtype(const KernelTable& k, DType dt) {
  const bool direct = (dt == DType::bf16 && k.gemm_bf16) || (dt == DType::f16 && k.gemm_f16);
  return direct ? dt : detail::compute_dtype(dt);
}

// Whether a product computed in `ct` rounds its operands to bf16:
// MixedPrecision's f32 products (engine/precision.h).
bool bf16_products(DType ct) { return ct == DType::f32 && mixed_precision_enabled(); }

// `x` without graph, in dtype `ct`, with its last two dims in a layout the
// GEMM maps directly (a copy only when neither of them has unit stride).
Tensor gemm_operand(const KernelTable& k, const Tensor& x, DType ct) {
  Tensor p = detail::as_plain(x, ct);
  const int64_t nd = p.dim();
  if (!k.gemm_maps(p.size(-2), p.size(-1), p.strides()[nd - 2], p.strides()[nd - 1]))
    p = p.contiguous();
  return p;
}

// Stride of one row when all dims but the last of `x` merge into a single row
// dim, or -1 when the layout does not allow it.
int64_t merged_row_stride(const Tensor& x) {
  int64_t stride = -1, expect = -1;
  for (int64_t d = x.dim() - 2; d >= 0; --d) {
    const int64_t n = x.shape()[d];
    if (n == 1) continue;
    if (stride == -1) {
      stride = x.strides()[d];
      expect = stride * n;
    } else if (x.strides()[d] != expect) {
      return -1;
    } else {
      expect *= n;
    }
  }
  return stride == -1 ? std::max<int64_t>(x.size(-1), 1) : stride;
}

// `x` (at least 1-d, no graph) seen as a [rows, x.size(-1)] GEMM operand:
// returns the tensor to read (x itself or a contiguous copy) and its strides.
Tensor as_rows(const KernelTable& k, const Tensor& x, int64_t& rs, int64_t& cs) {
  if (x.dim() == 1) {
    rs = std::max<int64_t>(x.size(0), 1);
    cs = x.strides()[0];
    return x;
  }
  const int64_t rows = x.numel() / std::max<int64_t>(x.size(-1), 1);
  rs = merged_row_stride(x);
  cs = x.strides()[x.dim() - 1];
  if (rs >= 0 && k.gemm_maps(rows, x.size(-1), rs, cs)) return x;
  Tensor c = x.contiguous();
  rs = std::max<int64_t>(x.size(-1), 1);
  cs = 1;
  return c;
}

// out[i, j] = a[i, :] . b[:, j] over the last two dims of operands that are
// both at least 2-d, batch dims broadcast; computed in `ct` (no graph).
Tensor matmul_forward(const Tensor& a, const Tensor& b, DType ct) {
  const KernelTable& k = kernels(a.device());
  const int64_t m = a.size(-2), kk = a.size(-1), n = b.size(-1);
  const Shape a_batch(a.shape().begin(), a.shape().end() - 2);
  const Shape b_batch(b.shape().begin(), b.shape().end() - 2);
  const Shape batch = broadcast_shapes(a_batch, b_batch, "matmul");
  Shape out_shape = batch;
  out_shape.push_back(m);
  out_shape.push_back(n);
  Tensor A = gemm_operand(k, a, ct), B = gemm_operand(k, b, ct);
  Tensor out = detail::make_tensor(out_shape, ct, a.device());
  const int64_t nb = numel_of(batch);
  const int64_t ad = A.dim(), bd = B.dim();
  GemmArgs g{.dtype = ct,
             .batch = nb,
             .m = m,
             .n = n,
             .k = kk,
             .a = {A.raw_data(), A.strides()[ad - 2], A.strides()[ad - 1]},
             .b = {B.raw_data(), B.strides()[bd - 2], B.strides()[bd - 1]},
             .c = out.raw_data(),
             .ldc = n,
             .bf16_products = bf16_products(ct)};
  // A batch of rows times one matrix: a single GEMM over the merged rows.
  if (numel_of(b_batch) == 1) {
    const int64_t rs = merged_row_stride(A);
    if (rs >= 0 && k.gemm_maps(nb * m, kk, rs, g.a.cs)) {
      g.batch = 1;
      g.m = nb * m;
      g.a.rs = rs;
      k.gemm(g);
      return out;
    }
  }
  // Element offsets of every product's operands (stride 0 where broadcast).
  const int64_t nd = static_cast<int64_t>(batch.size());
  std::vector<int64_t> a_off(nb), b_off(nb), idx(nd, 0);
  auto batch_stride = [&](const Tensor& t, const Shape& tb, int64_t d) -> int64_t {
    const int64_t td = d - (nd - static_cast<int64_t>(tb.size()));
    return td < 0 || tb[td] == 1 ? 0 : t.strides()[td];
  };
  for (int64_t i = 0; i < nb; ++i) {
    int64_t ao = 0, bo = 0;
    for (int64_t d = 0; d < nd; ++d) {
      ao += idx[d] * batch_stride(A, a_batch, d);
      bo += idx[d] * batch_stride(B, b_batch, d);
    }
    a_off[i] = ao;
    b_off[i] = bo;
    for (int64_t d = nd - 1; d >= 0; --d) {
      if (++idx[d] < batch[d]) break;
      idx[d] = 0;
    }
  }
  g.a_off = a_off.data();
  g.b_off = b_off.data();
  k.gemm(g);
  return out;
}

// Both operands at least 2-d and of dtype `dt`: forward plus backward node.
Tensor matmul_nd(const Tensor& a, const Tensor& b, DType dt) {
  const DType ct = gemm_dtype(kernels(a.device()), dt);
  Tensor out = matmul_forward(a, b, ct);
  if (ct != dt) out = detail::as_plain(out, dt);
  const bool need_a = a.requires_grad(), need_b = b.requires_grad();
  return autograd::record(
      "matmul", out, {a, b}, [a = a.detach(), b = b.detach(), need_a, need_b](const Tensor& g) {
        Tensor ga, gb;
        if (need_a) ga = sum_to(matmul(g, transpose(b, -1, -2)), a.shape());
        if (need_b) {
          if (b.dim() == 2 && a.dim() > 2) {
            // Batch of rows times one matrix: one GEMM over the merged rows.
            const int64_t rows = numel_of(Shape(a.shape().begin(), a.shape().end() - 1));
            gb = matmul(transpose(reshape(a, {rows, a.size(-1)}), 0, 1),
                        reshape(g, {rows, b.size(-1)}));
          } else {
            gb = sum_to(matmul(transpose(a, -1, -2), g), b.shape());
          }
        }
        return std::vector<Tensor>{ga, gb};
      });
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined()) throw std::invalid_argument("[matmul] got an undefined tensor");
  kernels_for("matmul", {&a, &b});  // one device for both
  if (a.dim() == 0 || b.dim() == 0)
    throw std::invalid_argument("[matmul] operands need at least 1 dim: got shapes " +
                                shapes_str(a, b));
  const int64_t ka = a.size(-1), kb = b.dim() == 1 ? b.size(0) : b.size(-2);
  if (ka != kb)
    throw std::invalid_argument("[matmul] inner dimensions differ: got shapes " + shapes_str(a, b) +
                                " (" + std::to_string(ka) + " vs " + std::to_string(kb) + ")");
  const DType dt = product_dtype("matmul", a, b);
  const Tensor A = cast(a, dt), B = cast(b, dt);
  if (a.dim() == 1 && b.dim() == 1)
    return reshape(matmul_nd(unsqueeze(A, 0), unsqueeze(B, 1), dt), {});
  if (a.dim() == 1) return squeeze(matmul_nd(unsqueeze(A, 0), B, dt), -2);
  if (b.dim() == 1) return squeeze(matmul_nd(A, unsqueeze(B, 1), dt), -1);
  return matmul_nd(A, B, dt);
}

Tensor bmm(const Tensor& a, const Tensor& b) {
  if (a.dim() != 3 || b.dim() != 3)
    throw std::invalid_argument("[bmm] needs 3-d operands: got shapes " + shapes_str(a, b));
  if (a.size(0) != b.size(0))
    throw std::invalid_argument("[bmm] batch sizes differ: got shapes " + shapes_str(a, b));
  if (a.size(2) != b.size(1))
    throw std::invalid_argument("[bmm] inner dimensions differ: got shapes " + shapes_str(a, b));
  return matmul(a, b);
}

// linear's weight gradient g^T x [out, in] from g [rows, out] and x [rows,
// in]. For a low-rank input side (LoRA's B: in 16, out 1280) the CPU's GEMM
// is faster the other way round, (x^T g)^T plus a copy of the small result:
// 0.29 against 0.39 ms at [2048, 1280] x [2048, 16], 0.80 against 1.06 at
// out 3456 (cold operands, medians of 21). On CUDA the copy is a launch of
// its own (a node of a captured step) for a product cuBLAS runs either way
// round, so it takes the product as it is (sim keeps the CPU's bits).
Tensor weight_grad(const Tensor& g, const Tensor& x) {
  const int64_t out_f = g.size(1), in_f = x.size(1);
  if (!g.device().is_cuda() && in_f <= 64 && out_f >= 4 * in_f)
    return transpose(matmul(transpose(x, 0, 1), g), 0, 1).contiguous();
  return matmul(transpose(g, 0, 1), x);
}

// linear's input gradient g w added onto `sum` (the sum of the input's other
// gradients the engine handed over, gradient_sink) by the GEMM, when the
// device multiplies the dtype as it is; false when it cannot.
bool add_input_grad(const Tensor& g, const Tensor& w, int64_t rows, const Tensor& sum) {
  const KernelTable& k = kernels(g.device());
  const DType dt = g.dtype();
  if (!sum.defined() || w.dtype() != dt || gemm_dtype(k, dt) != dt) return false;
  const int64_t out_f = w.size(0), in_f = w.size(1);
  const Tensor gc = g.contiguous();
  Tensor wp = w;
  if (!k.gemm_maps(out_f, in_f, wp.strides()[0], wp.strides()[1])) wp = wp.contiguous();
  k.gemm({.dtype = dt,
          .m = rows,
          .n = in_f,
          .k = out_f,
          .a = {gc.raw_data(), out_f, 1},
          .b = {wp.raw_data(), wp.strides()[0], wp.strides()[1]},
          .c = sum.raw_data(),
          .ldc = in_f,
          .accumulate = true,
          .bf16_products = bf16_products(dt)});
  return true;
}

// linear's product with what the GEMM starts from: the bias b broadcast
// over the rows, or (linear_add) a whole addend c of the output's shape; the
// GEMM accumulates onto it, so neither costs a pass of its own.
Tensor linear_onto(const char* op, const Tensor& x, const Tensor& w, const Tensor& b, Tensor c) {
  const KernelTable& k = kernels_for(op, {&x, &w, &b, &c});
  if (w.dim() != 2)
    throw std::invalid_argument(std::string("[") + op +
                                "] weight must be 2-d [out, in]: got shape " +
                                shape_str(w.shape()));
  if (x.dim() == 0 || x.size(-1) != w.size(1))
    throw std::invalid_argument(std::string("[") + op +
                                "] input's last dim must equal the weight's in features: got "
                                "input " +
                                shape_str(x.shape()) + " and weight " + shape_str(w.shape()));
  const int64_t out_f = w.size(0), in_f = w.size(1);
  if (b.defined() && (b.dim() != 1 || b.size(0) != out_f))
    throw std::invalid_argument(std::string("[") + op + "] bias must have shape [" +
                                std::to_string(out_f) + "]: got " + shape_str(b.shape()));
  Shape out_shape = x.shape();
  out_shape.back() = out_f;
  if (c.defined() && c.shape() != out_shape)
    throw std::invalid_argument(std::string("[") + op +
                                "] the addend must have the product's shape " +
                                shape_str(out_shape) + ": got " + shape_str(c.shape()));
  DType dt = product_dtype(op, x, w);
  if (b.defined()) dt = promote_types(dt, b.dtype());
  if (c.defined()) dt = promote_types(dt, c.dtype());
  const Tensor X = cast(x, dt), W = cast(w, dt), Bias = b.defined() ? cast(b, dt) : Tensor();
  const DType ct = gemm_dtype(k, dt);
  // An addend nobody else can see, already in the GEMM's dtype, is the
  // output's storage: the product lands on it with no copy.
  const bool onto_c = c.defined() && c.dtype() == ct && autograd::sole_storage(c);
  Tensor out = onto_c ? c.detach() : detail::make_tensor(out_shape, ct, x.device());
  const Tensor C = c.defined() ? cast(c, dt) : Tensor();
  int64_t xrs = 0, xcs = 0;
  Tensor xp = as_rows(k, detail::as_plain(X, ct), xrs, xcs);
  Tensor wp = detail::as_plain(W, ct);
  // w^T maps as a column-major [in, out] matrix: no copy for a plain weight.
  if (!k.gemm_maps(in_f, out_f, wp.strides()[1], wp.strides()[0])) wp = wp.contiguous();
  const int64_t rows = out.numel() / std::max<int64_t>(out_f, 1);
  if (Bias.defined()) {
    // Start from the bias and let the GEMM accumulate: no extra pass.
    Tensor bp = detail::as_plain(Bias, ct);
    const int64_t out_strides[2] = {out_f, 1}, bias_strides[2] = {0, bp.strides()[0]};
    k.copy({rows, out_f}, {out.raw_data(), ct, out_strides}, {bp.raw_data(), ct, bias_strides});
  } else if (C.defined() && !onto_c) {
    k.copy(out_shape, operand_of(out), operand_of(detail::as_plain(C, ct)));
  }
  k.gemm({.dtype = ct,
          .m = rows,
          .n = out_f,
          .k = in_f,
          .a = {xp.raw_data(), xrs, xcs},
          .b = {wp.raw_data(), wp.strides()[1], wp.strides()[0]},
          .c = out.raw_data(),
          .ldc = out_f,
          .accumulate = Bias.defined() || C.defined(),
          .bf16_products = bf16_products(ct)});
  if (ct != dt) out = detail::as_plain(out, dt);

  const bool need_x = X.requires_grad(), need_w = W.requires_grad();
  const bool need_b = Bias.defined() && Bias.requires_grad();
  const bool need_c = C.defined() && C.requires_grad();
  // Each operand is kept only for the other's gradient (a frozen weight's
  // layer keeps no copy of its input alive until the backward).
  return autograd::record(op, out, {X, W, Bias, C},
                          [x = need_w ? X.detach() : Tensor(), w = need_x ? W.detach() : Tensor(),
                           rows = numel_of(Shape(x.shape().begin(), x.shape().end() - 1)), need_x,
                           need_w, need_b, need_c, out_f, in_f](const Tensor& g) {
                            Tensor gx, gw, gb, gc;
                            if (need_x) {
                              Shape x_shape = g.shape();
                              x_shape.back() = in_f;
                              // Onto the sum of x's other gradients where the engine hands it over.
                              gx = autograd::gradient_sink(0, x_shape, g.dtype(), g.device());
                              if (!add_input_grad(g, w, rows, gx)) gx = matmul(g, w);
                            }
                            if (need_w || need_b) {
                              // Rows from the shape: -1 cannot be inferred when a feature size is
                              // 0.
                              Tensor g2 = reshape(g, {rows, out_f});
                              if (need_w) gw = weight_grad(g2, reshape(x, {rows, in_f}));
                              if (need_b) gb = sum(g2, {0});
                            }
                            if (need_c) gc = g;
                            return std::vector<Tensor>{gx, gw, gb, gc};
                          });
}

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b) {
  return linear_onto("linear", x, w, b, Tensor());
}

Tensor linear_add(Tensor c, const Tensor& x, const Tensor& w) {
  if (!c.defined()) throw std::invalid_argument("[linear_add] undefined addend");
  return linear_onto("linear_add", x, w, Tensor(), std::move(c));
}

Tensor outer(const Tensor& a, const Tensor& b) {
  if (a.dim() != 1 || b.dim() != 1)
    throw std::invalid_argument("[outer] needs 1-d operands: got shapes " + shapes_str(a, b));
  return mul(unsqueeze(a, 1), unsqueeze(b, 0));
}

Tensor sq_dist(const Tensor& x, const Tensor& c) {
  const KernelTable& k = kernels_for("sq_dist", {&x, &c});
  if (x.dim() != 2 || c.dim() != 2 || x.size(1) != c.size(1))
    throw std::invalid_argument(
        "[sq_dist] needs x [N, D] and c [K, D] with the same D: got "
        "shapes " +
        shapes_str(x, c));
  const DType dt = product_dtype("sq_dist", x, c);
  const Tensor X = cast(x, dt), C = cast(c, dt);
  const DType ct = detail::compute_dtype(dt);
  const int64_t N = x.size(0), K = c.size(0), D = x.size(1);
  Tensor xp = detail::as_plain(X, ct).contiguous(), cp = detail::as_plain(C, ct).contiguous();
  Tensor out = detail::make_tensor({N, K}, ct, x.device());
  // x c^T (c [K, D] read as a column-major [D, K] matrix), then the norms;
  // f32 products under MixedPrecision too: distances decide codes, and
  // |x|^2 - 2 x.c + |c|^2 cancels the operands' leading bits.
  k.gemm({.dtype = ct,
          .m = N,
          .n = K,
          .k = D,
          .a = {xp.raw_data(), D, 1},
          .b = {cp.raw_data(), 1, D},
          .c = out.raw_data(),
          .ldc = K});
  k.sq_dist_finish(ct, xp.raw_data(), cp.raw_data(), N, K, D, out.raw_data());
  if (ct != dt) out = detail::as_plain(out, dt);
  return autograd::record(
      "sq_dist", out, {X, C}, [x = X.detach(), c = C.detach(), d = out.detach()](const Tensor& g) {
        const MixedPrecision f32_products(false);  // as the forward's product
        // Clamped entries pass no gradient.
        Tensor gm = where(gt(d, constant_like(d, 0.0)), g, constant_like(g, 0.0));
        Tensor gx = (x * sum(gm, {1}, true) - matmul(gm, c)) * 2.0;
        Tensor gc = (c * unsqueeze(sum(gm, {0}), 1) - matmul(transpose(gm, 0, 1), x)) * 2.0;
        return std::vector<Tensor>{gx, gc};
      });
}

}  // namespace quanta
