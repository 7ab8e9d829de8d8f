// Products, extrema, moments, logsumexp, norms, cumsum and boolean tests:
// the device's row kernels (reduce_rows, stat_rows, index_rows, cumsum) over
// detail::plan_reduce rows, backward formulas with ops.
#include "engine/ops/reductions.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "engine/autograd/node.h"
#include "engine/dispatch.h"
#include "engine/factory.h"
#include "engine/kernels/table.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/kernel_call.h"
#include "engine/ops/op_helpers.h"
#include "engine/ops/reduce_plan.h"
#include "engine/ops/view.h"

namespace quanta {
namespace {

using detail::as_plain;
using detail::compute_dtype;
using detail::make_tensor;

using detail::one;

void check_arithmetic(const Tensor& x, const char* op) {
  if (!dtype_info(x.dtype()).arithmetic)
    detail::bad_dtype(op, x.dtype(), "a byte-only format: dequantize it first");
}

void check_floating(const Tensor& x, const char* op) {
  if (!is_floating(x.dtype()))
    throw std::invalid_argument(std::string("[") + op + "] needs a floating tensor, got " +
                                dtype_name(x.dtype()));
}

// A 0-d tensor accepts dims 0 and -1 (as in PyTorch) but has nothing to
// reduce over: validate, then plan it with no reduced dims.
Dims checked_dims(const Tensor& x, const Dims& dims, const char* op) {
  if (x.dim() != 0) return dims;
  wrap_dims(dims, 0, op);
  return {};
}

std::string dims_str(const Dims& d) { return shape_str(d); }

// Extrema have no identity: reducing zero values is an error, as in PyTorch.
void require_nonempty(const detail::ReducePlan& p, const Shape& shape, const char* op) {
  if (p.inner == 0)
    throw std::invalid_argument(
        std::string("[") + op + "] cannot reduce over a zero-size dim: input shape " +
        shape_str(shape) + ", reduced dims " + dims_str(p.dims) + "; the op has no identity");
}

// ---- prod ----

// d prod / d x_i: prod / x_i without zeros; with one zero only that position
// gets the product of the others; with two or more zeros everything is 0.
Tensor prod_backward(const Tensor& g, const Tensor& x, const Shape& kept, const Dims& dims) {
  const Tensor zero = constant_like(x, 0.0);
  const Tensor is_zero = eq(x, zero);
  const Tensor zeros_in_row = sum(is_zero, dims, true);
  const Tensor others = prod(where(is_zero, constant_like(x, 1.0), x), dims, true);
  const Tensor nonzero_grad =
      where(eq(zeros_in_row, constant_like(zeros_in_row, 0)), div(others, x), zero);
  const Tensor zero_grad = where(eq(zeros_in_row, constant_like(zeros_in_row, 1)), others, zero);
  return mul(reshape(g, kept), where(is_zero, zero_grad, nonzero_grad));
}

// ---- extrema ----

// bool compares as u8 and 16-bit floats as f32.
DType extreme_compute_dtype(const Tensor& x, const char* op) {
  check_arithmetic(x, op);
  return x.dtype() == DType::boolean ? DType::u8 : compute_dtype(x.dtype());
}

// Values (when wanted) and first indices of the extrema along `dim` (x not 0-d).
template <bool IsMax>
ValuesIndices extreme_dim(const Tensor& x, int64_t dim, bool keepdim, const char* op,
                          bool want_values) {
  const KernelTable& k = kernels_for(op, {&x});
  const DType ct = extreme_compute_dtype(x, op);
  auto p = detail::plan_reduce(as_plain(x, ct), {dim}, keepdim, op);
  require_nonempty(p, x.shape(), op);
  Tensor idx = make_tensor(p.out_shape, DType::i64, x.device());
  Tensor val = want_values ? make_tensor(p.out_shape, ct, x.device()) : Tensor();
  k.index_rows(IsMax ? RowReduce::max : RowReduce::min, p.rows.dtype(), p.rows.raw_data(), p.outer,
               p.inner, static_cast<int64_t*>(idx.raw_data()),
               want_values ? val.raw_data() : nullptr);
  if (want_values && ct != x.dtype()) val = as_plain(val, x.dtype());
  return {val, idx};
}

// Gradient of picking one element per row along `dim`: g lands on the picked
// index, zeros elsewhere.
Tensor scatter_along(const Tensor& g, const Tensor& idx, int64_t dim, const Shape& kept,
                     const Shape& in) {
  return scatter_add(zeros(in, options_of(g)), dim, reshape(idx, kept), reshape(g, kept));
}

template <bool IsMax>
ValuesIndices extreme_with_grad(const Tensor& x, int64_t dim, bool keepdim, const char* op) {
  if (x.dim() == 0) {
    wrap_dim(dim, 0, op);
    auto r = extreme_with_grad<IsMax>(reshape(x, {1}), 0, false, op);
    return {reshape(r.values, {}), reshape(r.indices, {})};
  }
  const int64_t d = wrap_dim(dim, x.dim(), op);
  auto r = extreme_dim<IsMax>(x, d, keepdim, op, true);
  Shape kept = x.shape();
  kept[d] = 1;
  r.values = autograd::record(op, r.values, {x},
                              [idx = r.indices, d, kept, in = x.shape()](const Tensor& g) {
                                return one(scatter_along(g, idx, d, kept, in));
                              });
  return r;
}

template <bool IsMax>
Tensor arg_extreme(const Tensor& x, int64_t dim, bool keepdim, const char* op) {
  if (x.dim() == 0) {
    wrap_dim(dim, 0, op);
    return reshape(arg_extreme<IsMax>(reshape(x.detach(), {1}), 0, false, op), {});
  }
  const int64_t d = wrap_dim(dim, x.dim(), op);
  return extreme_dim<IsMax>(x.detach(), d, keepdim, op, false).indices;
}

// Gradient of an extremum shared evenly among the elements equal to it.
Tensor even_split(const Tensor& g, const Tensor& x, const Tensor& out, const Shape& kept,
                  const Dims& dims) {
  const Tensor hit = eq(x, reshape(out, kept));
  const Tensor count = to_dtype(sum(hit, dims, true), g.dtype());
  return where(hit, div(reshape(g, kept), count), constant_like(g, 0.0));
}

template <bool IsMax>
Tensor amax_impl(const Tensor& x, const Dims& dims, bool keepdim, const char* op) {
  const KernelTable& k = kernels_for(op, {&x});
  const DType ct = extreme_compute_dtype(x, op);
  // 16-bit input: read as it is where the device reduces it in f32.
  const bool native = k.half_reductions && (x.dtype() == DType::bf16 || x.dtype() == DType::f16);
  auto p = detail::plan_reduce(native ? x : as_plain(x, ct), checked_dims(x, dims, op), keepdim, op,
                               true);
  require_nonempty(p, x.shape(), op);
  Tensor out = make_tensor(p.out_shape, ct, x.device());
  detail::reduce_planned(k, IsMax ? RowReduce::max : RowReduce::min, p, out.raw_data());
  if (ct != x.dtype()) out = as_plain(out, x.dtype());
  return autograd::record(op, out, {x},
                          [x = x.detach(), o = out.detach(), kept = p.kept_shape, d = p.dims](
                              const Tensor& g) { return one(even_split(g, x, o, kept, d)); });
}

// ---- var / std ----

Tensor moment(const Tensor& x, const Dims& dims, double correction, bool keepdim, bool take_sqrt) {
  const char* op = take_sqrt ? "std" : "var";
  const KernelTable& k = kernels_for(op, {&x});
  check_floating(x, op);
  const DType ct = compute_dtype(x.dtype());
  auto p = detail::plan_reduce(as_plain(x, ct), checked_dims(x, dims, op), keepdim, op);
  // Too few values for the correction divide by zero (NaN), as in PyTorch.
  const double divisor = std::max(0.0, static_cast<double>(p.inner) - correction);
  Tensor out = make_tensor(p.out_shape, ct, x.device());
  k.stat_rows(take_sqrt ? RowStat::std : RowStat::var, divisor, p.rows.dtype(), p.rows.raw_data(),
              p.outer, p.inner, out.raw_data());
  if (ct != x.dtype()) out = as_plain(out, x.dtype());
  return autograd::record(op, out, {x},
                          [x = x.detach(), o = out.detach(), kept = p.kept_shape, d = p.dims,
                           divisor, take_sqrt](const Tensor& g) {
                            Tensor gv = g;
                            // d std = d var / (2 std); taken as 0 where std is 0, like PyTorch.
                            if (take_sqrt)
                              gv = where(eq(o, constant_like(o, 0.0)), constant_like(g, 0.0),
                                         div(g, o * 2.0));
                            const Tensor dev = sub(x, mean(x, d, true));
                            return one(mul(reshape(gv, kept), dev * (2.0 / divisor)));
                          });
}

// ---- cumsum ----

Tensor cumsum_dir(const Tensor& x, int64_t dim, bool reverse) {
  const KernelTable& kt = kernels_for("cumsum", {&x});
  check_arithmetic(x, "cumsum");
  if (x.dim() == 0) {
    wrap_dim(dim, 0, "cumsum");
    return reshape(cumsum_dir(reshape(x, {1}), 0, reverse), {});
  }
  const int64_t d = wrap_dim(dim, x.dim(), "cumsum");
  const DType out_dt = is_floating(x.dtype()) ? x.dtype() : DType::i64;
  const DType ct = compute_dtype(out_dt);
  const Tensor in = as_plain(x, ct).contiguous();
  Tensor out = make_tensor(x.shape(), ct, x.device());
  // x viewed as [outer, n, inner]; the scan runs over n.
  int64_t outer = 1, inner = 1;
  for (int64_t k = 0; k < d; ++k) outer *= x.shape()[k];
  for (int64_t k = d + 1; k < x.dim(); ++k) inner *= x.shape()[k];
  kt.cumsum(ct, in.raw_data(), outer, x.shape()[d], inner, reverse, out.raw_data());
  if (ct != out_dt) out = as_plain(out, out_dt);
  // The gradient of a running sum is the running sum from the other end.
  return autograd::record("cumsum", out, {x}, [d, reverse](const Tensor& g) {
    return one(cumsum_dir(g, d, !reverse));
  });
}

// ---- all / any ----

template <bool All>
Tensor bool_reduce(const Tensor& x, const Dims& dims, bool keepdim, const char* op) {
  const KernelTable& k = kernels_for(op, {&x});
  check_arithmetic(x, op);
  auto p = detail::plan_reduce(as_plain(x, DType::boolean), checked_dims(x, dims, op), keepdim, op,
                               true);
  Tensor out = make_tensor(p.out_shape, DType::boolean, x.device());
  detail::reduce_planned(k, All ? RowReduce::all : RowReduce::any, p, out.raw_data());
  return out;
}

}  // namespace

Tensor prod(const Tensor& x, const Dims& dims, bool keepdim) {
  const KernelTable& k = kernels_for("prod", {&x});
  check_arithmetic(x, "prod");
  const DType out_dt = is_floating(x.dtype()) ? x.dtype() : DType::i64;
  const DType ct = compute_dtype(out_dt);
  auto p =
      detail::plan_reduce(as_plain(x, ct), checked_dims(x, dims, "prod"), keepdim, "prod", true);
  Tensor out = make_tensor(p.out_shape, ct, x.device());
  // Integers multiply as unsigned 64-bit: overflow wraps.
  detail::reduce_planned(k, RowReduce::prod, p, out.raw_data());
  if (ct != out_dt) out = as_plain(out, out_dt);
  return autograd::record("prod", out, {x},
                          [x = x.detach(), kept = p.kept_shape, d = p.dims](const Tensor& g) {
                            return one(prod_backward(g, x, kept, d));
                          });
}

ValuesIndices max(const Tensor& x, int64_t dim, bool keepdim) {
  return extreme_with_grad<true>(x, dim, keepdim, "max");
}
ValuesIndices min(const Tensor& x, int64_t dim, bool keepdim) {
  return extreme_with_grad<false>(x, dim, keepdim, "min");
}
Tensor max(const Tensor& x) { return amax_impl<true>(x, {}, false, "max"); }
Tensor min(const Tensor& x) { return amax_impl<false>(x, {}, false, "min"); }
Tensor amax(const Tensor& x, const Dims& dims, bool keepdim) {
  return amax_impl<true>(x, dims, keepdim, "amax");
}
Tensor amin(const Tensor& x, const Dims& dims, bool keepdim) {
  return amax_impl<false>(x, dims, keepdim, "amin");
}
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) {
  return arg_extreme<true>(x, dim, keepdim, "argmax");
}
Tensor argmin(const Tensor& x, int64_t dim, bool keepdim) {
  return arg_extreme<false>(x, dim, keepdim, "argmin");
}

Tensor var(const Tensor& x, const Dims& dims, double correction, bool keepdim) {
  return moment(x, dims, correction, keepdim, false);
}
Tensor std(const Tensor& x, const Dims& dims, double correction, bool keepdim) {
  return moment(x, dims, correction, keepdim, true);
}

Tensor logsumexp(const Tensor& x, const Dims& dims, bool keepdim) {
  const KernelTable& k = kernels_for("logsumexp", {&x});
  check_arithmetic(x, "logsumexp");
  const DType out_dt = to_floating(x.dtype());
  const DType ct = compute_dtype(out_dt);
  auto p = detail::plan_reduce(as_plain(x, ct), checked_dims(x, dims, "logsumexp"), keepdim,
                               "logsumexp");
  Tensor out = make_tensor(p.out_shape, ct, x.device());
  // NaN stays NaN; all -inf (or an empty row) gives -inf; any +inf gives +inf.
  k.reduce_rows(RowReduce::logsumexp, p.rows.dtype(), p.rows.raw_data(), p.outer, p.inner,
                out.raw_data());
  if (ct != out_dt) out = as_plain(out, out_dt);
  return autograd::record(
      "logsumexp", out, {x},
      [x = x.detach(), o = out.detach(), kept = p.kept_shape](const Tensor& g) {
        const Tensor ok = reshape(o, kept);
        const Tensor gx = mul(reshape(g, kept), exp(sub(x, ok)));
        // A row of -inf has no direction of ascent: 0 instead of exp(-inf + inf) = NaN.
        return one(where(eq(ok, constant_like(ok, -INFINITY)), constant_like(gx, 0.0), gx));
      });
}

Tensor norm(const Tensor& x, double p, const Dims& dims, bool keepdim) {
  const KernelTable& k = kernels_for("norm", {&x});
  check_floating(x, "norm");
  if (!(p > 0))
    throw std::invalid_argument("[norm] p must be > 0 or INFINITY, got " + std::to_string(p));
  const bool inf = std::isinf(p);
  const DType ct = compute_dtype(x.dtype());
  auto plan = detail::plan_reduce(as_plain(x, ct), checked_dims(x, dims, "norm"), keepdim, "norm");
  if (inf) require_nonempty(plan, x.shape(), "norm");  // the inf-norm is a max
  Tensor out = make_tensor(plan.out_shape, ct, x.device());
  k.stat_rows(RowStat::norm, p, plan.rows.dtype(), plan.rows.raw_data(), plan.outer, plan.inner,
              out.raw_data());
  if (ct != x.dtype()) out = as_plain(out, x.dtype());
  return autograd::record(
      "norm", out, {x},
      [x = x.detach(), o = out.detach(), kept = plan.kept_shape, d = plan.dims, p,
       inf](const Tensor& g) {
        const Tensor gk = reshape(g, kept);
        if (p == 1.0) return one(mul(gk, sign(x)));
        if (inf) return one(mul(even_split(g, abs(x), o, kept, d), sign(x)));
        const Tensor ok = reshape(o, kept);
        // p = 2: x / |x|; general p: x |x|^(p-2) / |x|_p^(p-1); 0 at a zero vector.
        const Tensor gx = p == 2.0 ? div(mul(gk, x), ok)
                                   : div(mul(gk, mul(x, pow(abs(x), p - 2.0))), pow(ok, p - 1.0));
        return one(where(eq(ok, constant_like(ok, 0.0)), constant_like(gx, 0.0), gx));
      });
}

Tensor cumsum(const Tensor& x, int64_t dim) { return cumsum_dir(x, dim, false); }

Tensor all(const Tensor& x, const Dims& dims, bool keepdim) {
  return bool_reduce<true>(x, dims, keepdim, "all");
}
Tensor any(const Tensor& x, const Dims& dims, bool keepdim) {
  return bool_reduce<false>(x, dims, keepdim, "any");
}

}  // namespace quanta
