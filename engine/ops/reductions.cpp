// Products, extrema, moments, logsumexp, norms, cumsum and boolean tests:
// forward kernels over cpu::plan_reduce rows, backward formulas with ops.
#include "engine/ops/reductions.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>

#include <Eigen/Core>

#include "engine/autograd/node.h"
#include "engine/cpu/parallel.h"
#include "engine/cpu/reduce_plan.h"
#include "engine/device_check.h"
#include "engine/dispatch.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/elementwise_kernels.h"
#include "engine/ops/index.h"
#include "engine/ops/view.h"

namespace quanta {
namespace {

using detail::as_plain;
using detail::cpu_compute_dtype;
using detail::make_tensor;

std::vector<Tensor> one(Tensor g) { return {std::move(g)}; }

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
void require_nonempty(const cpu::ReducePlan& p, const Shape& shape, const char* op) {
  if (p.inner == 0)
    throw std::invalid_argument(std::string("[") + op +
                                "] cannot reduce over a zero-size dim: input shape " +
                                shape_str(shape) + ", reduced dims " + dims_str(p.dims) +
                                "; the op has no identity");
}

// Calls f(r, row, n) for each of the plan's `outer` rows (in parallel).
template <class T, class F>
void for_rows(const cpu::ReducePlan& p, F f) {
  const T* in = p.rows.data<T>();
  const int64_t n = p.inner;
  const int64_t grain = std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(n, 1));
  cpu::parallel_for(0, p.outer, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) f(r, in + r * n, n);
  });
}

// ---- prod ----

// d prod / d x_i: prod / x_i without zeros; with one zero only that position
// gets the product of the others; with two or more zeros everything is 0.
Tensor prod_backward(const Tensor& g, const Tensor& x, const Shape& kept, const Dims& dims) {
  const Tensor zero = scalar_like(x, 0.0);
  const Tensor is_zero = eq(x, zero);
  const Tensor zeros_in_row = sum(is_zero, dims, true);
  const Tensor others = prod(where(is_zero, scalar_like(x, 1.0), x), dims, true);
  const Tensor nonzero_grad =
      where(eq(zeros_in_row, scalar_like(zeros_in_row, 0)), div(others, x), zero);
  const Tensor zero_grad = where(eq(zeros_in_row, scalar_like(zeros_in_row, 1)), others, zero);
  return mul(reshape(g, kept), where(is_zero, zero_grad, nonzero_grad));
}

// ---- extrema ----

// NaN beats everything (the first NaN is kept), as in PyTorch's max/min.
template <bool IsMax, class T>
inline bool better(T v, T best) {
  if constexpr (std::is_floating_point_v<T>) {
    if (v != v) return best == best;
  }
  return IsMax ? v > best : v < best;
}

// Index of the first extremum of n >= 1 values.
template <bool IsMax, class T>
int64_t extreme_index(const T* v, int64_t n) {
  int64_t k = 0;
  for (int64_t i = 1; i < n; ++i)
    if (better<IsMax>(v[i], v[k])) k = i;
  return k;
}

// bool compares as u8 and 16-bit floats as f32.
DType extreme_compute_dtype(const Tensor& x, const char* op) {
  check_arithmetic(x, op);
  return x.dtype() == DType::boolean ? DType::u8 : cpu_compute_dtype(x.dtype());
}

// Values (when wanted) and first indices of the extrema along `dim` (x not 0-d).
template <bool IsMax>
ValuesIndices extreme_dim(const Tensor& x, int64_t dim, bool keepdim, const char* op,
                          bool want_values) {
  detail::check_cpu(op, {&x});
  const DType ct = extreme_compute_dtype(x, op);
  auto p = cpu::plan_reduce(as_plain(x, ct), {dim}, keepdim, op);
  require_nonempty(p, x.shape(), op);
  Tensor idx = make_tensor(p.out_shape, DType::i64, Device::cpu());
  Tensor val = want_values ? make_tensor(p.out_shape, ct, Device::cpu()) : Tensor();
  dispatch_numeric(ct, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    int64_t* io = idx.data<int64_t>();
    T* vo = want_values ? val.data<T>() : nullptr;
    for_rows<T>(p, [&](int64_t r, const T* v, int64_t n) {
      const int64_t k = extreme_index<IsMax>(v, n);
      io[r] = k;
      if (vo) vo[r] = v[k];
    });
  });
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
  return where(hit, div(reshape(g, kept), count), scalar_like(g, 0.0));
}

template <bool IsMax>
Tensor amax_impl(const Tensor& x, const Dims& dims, bool keepdim, const char* op) {
  detail::check_cpu(op, {&x});
  const DType ct = extreme_compute_dtype(x, op);
  auto p = cpu::plan_reduce(as_plain(x, ct), checked_dims(x, dims, op), keepdim, op);
  require_nonempty(p, x.shape(), op);
  Tensor out = make_tensor(p.out_shape, ct, Device::cpu());
  dispatch_numeric(ct, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = out.data<T>();
    for_rows<T>(p, [&](int64_t r, const T* v, int64_t n) {
      o[r] = v[extreme_index<IsMax>(v, n)];
    });
  });
  if (ct != x.dtype()) out = as_plain(out, x.dtype());
  return autograd::record(op, out, {x},
                          [x = x.detach(), o = out.detach(), kept = p.kept_shape,
                           d = p.dims](const Tensor& g) {
    return one(even_split(g, x, o, kept, d));
  });
}

// ---- var / std ----

Tensor moment(const Tensor& x, const Dims& dims, double correction, bool keepdim,
              bool take_sqrt) {
  const char* op = take_sqrt ? "std" : "var";
  detail::check_cpu(op, {&x});
  check_floating(x, op);
  const DType ct = cpu_compute_dtype(x.dtype());
  auto p = cpu::plan_reduce(as_plain(x, ct), checked_dims(x, dims, op), keepdim, op);
  // Too few values for the correction divide by zero (NaN), as in PyTorch.
  const double divisor = std::max(0.0, static_cast<double>(p.inner) - correction);
  Tensor out = make_tensor(p.out_shape, ct, Device::cpu());
  dispatch_float(ct, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = out.data<T>();
    using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
    for_rows<T>(p, [&](int64_t r, const T* v, int64_t n) {
      // Two passes: squared deviations, no cancellation from sum(x^2) - n mean^2.
      Eigen::Map<const Arr> a(v, n);
      const T m = n ? a.mean() : T(NAN);
      const double res = static_cast<double>((a - m).square().sum()) / divisor;
      o[r] = static_cast<T>(take_sqrt ? std::sqrt(res) : res);
    });
  });
  if (ct != x.dtype()) out = as_plain(out, x.dtype());
  return autograd::record(op, out, {x},
                          [x = x.detach(), o = out.detach(), kept = p.kept_shape, d = p.dims,
                           divisor, take_sqrt](const Tensor& g) {
    Tensor gv = g;
    // d std = d var / (2 std); taken as 0 where std is 0, like PyTorch.
    if (take_sqrt)
      gv = where(eq(o, scalar_like(o, 0.0)), scalar_like(g, 0.0), div(g, o * 2.0));
    const Tensor dev = sub(x, mean(x, d, true));
    return one(mul(reshape(gv, kept), dev * (2.0 / divisor)));
  });
}

// ---- cumsum ----

Tensor cumsum_dir(const Tensor& x, int64_t dim, bool reverse) {
  detail::check_cpu("cumsum", {&x});
  check_arithmetic(x, "cumsum");
  if (x.dim() == 0) {
    wrap_dim(dim, 0, "cumsum");
    return reshape(cumsum_dir(reshape(x, {1}), 0, reverse), {});
  }
  const int64_t d = wrap_dim(dim, x.dim(), "cumsum");
  const DType out_dt = is_floating(x.dtype()) ? x.dtype() : DType::i64;
  const DType ct = cpu_compute_dtype(out_dt);
  const Tensor in = as_plain(x, ct).contiguous();
  Tensor out = make_tensor(x.shape(), ct, Device::cpu());
  // x viewed as [outer, n, inner]; the scan runs over n, vectorised over inner.
  int64_t outer = 1, inner = 1;
  for (int64_t k = 0; k < d; ++k) outer *= x.shape()[k];
  for (int64_t k = d + 1; k < x.dim(); ++k) inner *= x.shape()[k];
  const int64_t n = x.shape()[d];
  dispatch_numeric(ct, "cumsum", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* src = in.data<T>();
    T* dst = out.data<T>();
    const int64_t block = n * inner;
    cpu::parallel_for(0, n == 0 ? 0 : outer,
                      std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(block, 1)),
                      [&](int64_t lo, int64_t hi) {
      for (int64_t o = lo; o < hi; ++o) {
        const T* s = src + o * block;
        T* t = dst + o * block;
        if (inner == 1) {
          // One contiguous line: a plain running sum.
          T acc = T(0);
          for (int64_t i = 0; i < n; ++i) {
            const int64_t j = reverse ? n - 1 - i : i;
            acc = static_cast<T>(acc + s[j]);
            t[j] = acc;
          }
          continue;
        }
        const int64_t first = reverse ? n - 1 : 0, step = reverse ? -1 : 1;
        for (int64_t k = 0; k < inner; ++k) t[first * inner + k] = s[first * inner + k];
        for (int64_t i = first + step; i >= 0 && i < n; i += step) {
          const T* prev = t + (i - step) * inner;
          for (int64_t k = 0; k < inner; ++k) t[i * inner + k] = prev[k] + s[i * inner + k];
        }
      }
    });
  });
  if (ct != out_dt) out = as_plain(out, out_dt);
  // The gradient of a running sum is the running sum from the other end.
  return autograd::record("cumsum", out, {x}, [d, reverse](const Tensor& g) {
    return one(cumsum_dir(g, d, !reverse));
  });
}

// ---- all / any ----

template <bool All>
Tensor bool_reduce(const Tensor& x, const Dims& dims, bool keepdim, const char* op) {
  detail::check_cpu(op, {&x});
  check_arithmetic(x, op);
  auto p = cpu::plan_reduce(as_plain(x, DType::boolean), checked_dims(x, dims, op), keepdim,
                            op);
  Tensor out = make_tensor(p.out_shape, DType::boolean, Device::cpu());
  bool* o = out.data<bool>();
  for_rows<bool>(p, [&](int64_t r, const bool* v, int64_t n) {
    bool acc = All;
    for (int64_t i = 0; i < n; ++i)
      if (v[i] != All) {
        acc = !All;
        break;
      }
    o[r] = acc;
  });
  return out;
}

}  // namespace

Tensor prod(const Tensor& x, const Dims& dims, bool keepdim) {
  detail::check_cpu("prod", {&x});
  check_arithmetic(x, "prod");
  const DType out_dt = is_floating(x.dtype()) ? x.dtype() : DType::i64;
  const DType ct = cpu_compute_dtype(out_dt);
  auto p = cpu::plan_reduce(as_plain(x, ct), checked_dims(x, dims, "prod"), keepdim, "prod");
  Tensor out = make_tensor(p.out_shape, ct, Device::cpu());
  dispatch_numeric(ct, "prod", [&](auto tag) {
    using T = typename decltype(tag)::type;
    // Integers multiply as unsigned: overflow wraps instead of being UB.
    using Acc = std::conditional_t<std::is_integral_v<T>, uint64_t, T>;
    T* o = out.data<T>();
    for_rows<T>(p, [&](int64_t r, const T* v, int64_t n) {
      Acc acc = Acc(1);
      for (int64_t i = 0; i < n; ++i) acc *= static_cast<Acc>(v[i]);
      o[r] = static_cast<T>(acc);
    });
  });
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
  detail::check_cpu("logsumexp", {&x});
  check_arithmetic(x, "logsumexp");
  const DType out_dt = to_floating(x.dtype());
  const DType ct = cpu_compute_dtype(out_dt);
  auto p = cpu::plan_reduce(as_plain(x, ct), checked_dims(x, dims, "logsumexp"), keepdim,
                            "logsumexp");
  Tensor out = make_tensor(p.out_shape, ct, Device::cpu());
  dispatch_float(ct, "logsumexp", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = out.data<T>();
    using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
    for_rows<T>(p, [&](int64_t r, const T* v, int64_t n) {
      if (n == 0) {
        o[r] = T(-INFINITY);
        return;
      }
      Eigen::Map<const Arr> a(v, n);
      const T m = a.template maxCoeff<Eigen::PropagateNaN>();
      // NaN stays NaN; all -inf gives -inf; any +inf gives +inf.
      o[r] = std::isfinite(m) ? m + std::log((a - m).exp().sum()) : m;
    });
  });
  if (ct != out_dt) out = as_plain(out, out_dt);
  return autograd::record("logsumexp", out, {x},
                          [x = x.detach(), o = out.detach(),
                           kept = p.kept_shape](const Tensor& g) {
    const Tensor ok = reshape(o, kept);
    const Tensor gx = mul(reshape(g, kept), exp(sub(x, ok)));
    // A row of -inf has no direction of ascent: 0 instead of exp(-inf + inf) = NaN.
    return one(where(eq(ok, scalar_like(ok, -INFINITY)), scalar_like(gx, 0.0), gx));
  });
}

Tensor norm(const Tensor& x, double p, const Dims& dims, bool keepdim) {
  detail::check_cpu("norm", {&x});
  check_floating(x, "norm");
  if (!(p > 0))
    throw std::invalid_argument("[norm] p must be > 0 or INFINITY, got " + std::to_string(p));
  const bool inf = std::isinf(p);
  const DType ct = cpu_compute_dtype(x.dtype());
  auto plan =
      cpu::plan_reduce(as_plain(x, ct), checked_dims(x, dims, "norm"), keepdim, "norm");
  if (inf) require_nonempty(plan, x.shape(), "norm");  // the inf-norm is a max
  Tensor out = make_tensor(plan.out_shape, ct, Device::cpu());
  dispatch_float(ct, "norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = out.data<T>();
    for_rows<T>(plan, [&](int64_t r, const T* v, int64_t n) {
      double acc = 0;
      if (inf) {
        for (int64_t i = 0; i < n; ++i) {
          const double a = std::abs(static_cast<double>(v[i]));
          if (a != a) {
            acc = a;
            break;
          }
          acc = std::max(acc, a);
        }
      } else if (p == 1.0) {
        for (int64_t i = 0; i < n; ++i) acc += std::abs(static_cast<double>(v[i]));
      } else if (p == 2.0) {
        for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(v[i]) * v[i];
        acc = std::sqrt(acc);
      } else {
        for (int64_t i = 0; i < n; ++i)
          acc += std::pow(std::abs(static_cast<double>(v[i])), p);
        acc = std::pow(acc, 1.0 / p);
      }
      o[r] = static_cast<T>(acc);
    });
  });
  if (ct != x.dtype()) out = as_plain(out, x.dtype());
  return autograd::record("norm", out, {x},
                          [x = x.detach(), o = out.detach(), kept = plan.kept_shape,
                           d = plan.dims, p, inf](const Tensor& g) {
    const Tensor gk = reshape(g, kept);
    if (p == 1.0) return one(mul(gk, sign(x)));
    if (inf) return one(mul(even_split(g, abs(x), o, kept, d), sign(x)));
    const Tensor ok = reshape(o, kept);
    // p = 2: x / |x|; general p: x |x|^(p-2) / |x|_p^(p-1); 0 at a zero vector.
    const Tensor gx = p == 2.0 ? div(mul(gk, x), ok)
                               : div(mul(gk, mul(x, pow(abs(x), p - 2.0))), pow(ok, p - 1.0));
    return one(where(eq(ok, scalar_like(ok, 0.0)), scalar_like(gx, 0.0), gx));
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
