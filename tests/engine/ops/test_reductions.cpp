// Op-harness rows for the reductions, softmax and the normalisation-free
// reductions in reductions.h, plus direct checks of empty reductions, ties,
// NaN, stability and errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>

#include "engine/ops/harness.h"
#include "engine/ops/reduce_plan.h"
#include "support/gpu.h"

using namespace quanta;
using namespace quanta::testing;

namespace {

using Values = std::vector<double>;

using RowFn = std::function<double(const Values&)>;

// One row reducing input 0 over `dims` with `op`, checked against `ref` over
// the same dims (negative dims let one row serve inputs of different rank).
using ReduceFn = std::function<Tensor(const Tensor&, const Dims&, bool)>;
OpCase reduce_case(const std::string& name, const ReduceFn& op, const RowFn& ref, Shape shape,
                   Dims dims, bool keepdim, Domain domain = Domain::any, Shape zero_shape = {}) {
  OpCase c;
  c.name = name + " dims " + shape_str(dims) + (keepdim ? " keepdim" : "");
  c.shapes = {std::move(shape)};
  if (!zero_shape.empty()) c.zero_shapes = {std::move(zero_shape)};
  c.inputs = {spec(domain)};
  c.op = [=](const Inputs& x) { return op(x[0], dims, keepdim); };
  c.reference = [=](const Inputs& x) { return ref_reduce(x[0], dims, keepdim, ref); };
  return c;
}

// Applies `f` to every line of `x` along `dim` (a reference for cumsum and
// softmax); returns f64 of x's shape.
Tensor ref_along(const Tensor& x, int64_t dim, const std::function<Values(const Values&)>& f) {
  const Shape& s = x.shape();
  dim = wrap_dim(dim, x.dim(), "ref_along");
  const Values v = x.to_vector<double>();
  Values out(v.size());
  for (int64_t i = 0; i < x.numel(); ++i) {
    auto idx = unravel(i, s);
    if (idx[dim] != 0) continue;  // visit each line once, from its first element
    Values line;
    for (int64_t j = 0; j < s[dim]; ++j) {
      idx[dim] = j;
      line.push_back(v[ravel(idx, s)]);
    }
    const Values r = f(line);
    for (int64_t j = 0; j < s[dim]; ++j) {
      idx[dim] = j;
      out[ravel(idx, s)] = r[j];
    }
  }
  const int64_t n = x.numel();
  return from_vector<double>(out, n ? Shape{n} : Shape{0}).reshape(s);
}

OpCase along_case(std::string name, Shape shape, int64_t dim,
                  std::function<Tensor(const Tensor&, int64_t)> op,
                  std::function<Values(const Values&)> ref, Shape zero_shape = {}) {
  OpCase c;
  c.name = std::move(name);
  c.shapes = {std::move(shape)};
  if (!zero_shape.empty()) c.zero_shapes = {std::move(zero_shape)};
  c.op = [op, dim](const Inputs& x) { return op(x[0], dim); };
  c.reference = [ref, dim](const Inputs& x) { return ref_along(x[0], dim, ref); };
  return c;
}

double r_sum(const Values& v) { return std::accumulate(v.begin(), v.end(), 0.0); }
// 0 / 0 = NaN for an empty slice, as mean promises (NumPy, PyTorch).
double r_mean(const Values& v) { return r_sum(v) / static_cast<double>(v.size()); }
double r_prod(const Values& v) {
  return std::accumulate(v.begin(), v.end(), 1.0, std::multiplies<double>());
}
double r_max(const Values& v) { return *std::max_element(v.begin(), v.end()); }
double r_min(const Values& v) { return *std::min_element(v.begin(), v.end()); }
double r_argmax(const Values& v) { return std::max_element(v.begin(), v.end()) - v.begin(); }
double r_argmin(const Values& v) { return std::min_element(v.begin(), v.end()) - v.begin(); }
RowFn r_var(double correction, bool take_sqrt) {
  return [=](const Values& v) {
    const double n = static_cast<double>(v.size());
    const double m = std::accumulate(v.begin(), v.end(), 0.0) / n;
    double ss = 0;
    for (double a : v) ss += (a - m) * (a - m);
    const double r = ss / std::max(0.0, n - correction);
    return take_sqrt ? std::sqrt(r) : r;
  };
}
double r_logsumexp(const Values& v) {
  double s = 0;
  for (double a : v) s += std::exp(a);
  return std::log(s);
}
RowFn r_norm(double p) {
  return [p](const Values& v) {
    if (std::isinf(p)) {
      double m = 0;
      for (double a : v) m = std::max(m, std::abs(a));
      return m;
    }
    double s = 0;
    for (double a : v) s += std::pow(std::abs(a), p);
    return std::pow(s, 1.0 / p);
  };
}

// Inputs of prod with zeros placed so that rows of a [4, 3] input hold no,
// one, two and three zeros (reduced over dim 1).
Tensor with_zeros(const Shape& shape, uint64_t seed) {
  auto v = make_input(shape, Domain::away_from_zero, seed).to_vector<double>();
  for (int64_t i : {4, 6, 7, 9, 10, 11})
    if (i < static_cast<int64_t>(v.size())) v[i] = 0;
  return from_vector<double>(v, {static_cast<int64_t>(v.size())}).reshape(shape);
}

Tensor bool_input(const Shape& shape, uint64_t seed) {
  return gt(make_input(shape, Domain::any, seed), scalar(0.7, {.dtype = DType::f64}));
}

Tensor t64(std::vector<double> v, Shape shape = {}) {
  if (shape.empty()) shape = {static_cast<int64_t>(v.size())};
  return from_vector<double>(v, shape);
}

std::vector<double> vals(const Tensor& t) { return t.to_vector<double>(); }

}  // namespace

TEST_CASE("sum and mean through the harness") {
  const ReduceFn sum_fn = [](const Tensor& x, const Dims& d, bool k) { return sum(x, d, k); };
  const ReduceFn mean_fn = [](const Tensor& x, const Dims& d, bool k) { return mean(x, d, k); };
  const Domain any = Domain::any;
  for (bool keep : {false, true}) {
    for (const auto& [name, op, ref] :
         {std::tuple{"sum", sum_fn, RowFn(r_sum)}, std::tuple{"mean", mean_fn, RowFn(r_mean)}}) {
      // One dim, with an empty reduced dim (sum 0, mean NaN) in the zero-size
      // variant; one dim of an empty kept dim.
      run_case(reduce_case(name, op, ref, {3, 4, 5}, {1}, keep, any, {3, 0, 5}));
      run_case(reduce_case(name, op, ref, {3, 4, 5}, {-1}, keep, any, {0, 4, 5}));
      // Several dims, negative and out of order.
      run_case(reduce_case(name, op, ref, {3, 4, 5}, {-1, 0}, keep, any, {3, 0, 5}));
      // All dims: empty `dims` and every dim named.
      run_case(reduce_case(name, op, ref, {3, 4}, {}, keep, any, {0, 4}));
      run_case(reduce_case(name, op, ref, {2, 3, 4}, {0, 1, 2}, keep, any, {2, 3, 0}));
    }
  }
}

TEST_CASE("sum and mean of an expanded (stride-0, broadcast) input through the harness") {
  // The input is broadcast to [2, 3, 4, 5] before the reduction, so the
  // kernel reads stride-0 dims and the gradient sums back through expand.
  for (const auto& [name, op, ref] :
       {std::tuple{"sum", ReduceFn([](const Tensor&x, const Dims&d, bool k) {
                     return sum(expand(x, {2, x.size(0), 4, x.size(2)}), d, k);
                   }),
                   RowFn(r_sum)},
        std::tuple{"mean", ReduceFn([](const Tensor&x, const Dims&d, bool k) {
                     return mean(expand(x, {2, x.size(0), 4, x.size(2)}), d, k);
                   }),
                   RowFn(r_mean)}}) {
    for (bool keep : {false, true}) {
      const Dims dims = {0, 2};
      OpCase c = reduce_case(std::string(name) + " of expand", op, ref, {3, 1, 5}, dims, keep,
                             Domain::any, {0, 1, 5});
      c.reference = [ref, dims, keep](const Inputs& x) {
        const Shape wide = {2, x[0].size(0), 4, x[0].size(2)};
        const Tensor b = ref_elementwise({x[0], zeros(wide, {.dtype = DType::f64})},
                                         [](const Values& v) { return v[0]; });
        return ref_reduce(b, dims, keep, ref);
      };
      run_case(c);
    }
  }
}

TEST_CASE("sum of a long row (split across threads) and of integers") {
  // Past kGrainElements a whole-tensor sum runs in per-thread parts; the
  // harness's O(n^2) gradient check is too slow for rows that long.
  Tensor x = make_input({100003}, Domain::any, 17);
  const Values v = vals(x);
  CHECK(sum(x).item() == doctest::Approx(r_sum(v)).epsilon(1e-12));
  CHECK(mean(x.to(DType::f32)).item() == doctest::Approx(r_mean(v)).epsilon(1e-5));
  mean(x.requires_grad_()).backward();
  const Values g = vals(x.grad());
  CHECK(std::all_of(g.begin(), g.end(),
                    [](double a) { return a == doctest::Approx(1.0 / 100003).epsilon(1e-12); }));
  const Tensor i = from_vector<int32_t>({3, -1, 4, 1, 5}, {5});
  CHECK(sum(i).dtype() == DType::i64);
  CHECK(sum(i).item() == 12.0);
  CHECK(sum(from_vector<bool>({true, false, true})).item<int64_t>() == 2);
  CHECK(sum(zeros({0, 3}, {.dtype = DType::i32}), {0}).dtype() == DType::i64);
  CHECK_THROWS_WITH_AS(mean(i), doctest::Contains("[mean] needs a floating tensor, got i32"),
                       std::invalid_argument);
}

TEST_CASE("prod through the harness") {
  const ReduceFn op = [](const Tensor& x, const Dims& d, bool k) { return prod(x, d, k); };
  run_case(reduce_case("prod", op, r_prod, {3, 4}, {1}, false, Domain::any, {3, 0}));
  run_case(reduce_case("prod", op, r_prod, {2, 3, 4}, {0, -1}, true, Domain::any, {0, 3, 4}));
  run_case(reduce_case("prod", op, r_prod, {2, 3}, {}, false));
  OpCase with_zero_rows = reduce_case("prod with zeros", op, r_prod, {4, 3}, {1}, false);
  with_zero_rows.inputs = {spec(with_zeros)};
  run_case(with_zero_rows);
}

TEST_CASE("max, min, amax, amin, argmax, argmin through the harness") {
  const Domain d = Domain::distinct;
  const ReduceFn max_dim = [](const Tensor& x, const Dims& dims, bool k) {
    return max(x, dims[0], k).values;
  };
  const ReduceFn min_dim = [](const Tensor& x, const Dims& dims, bool k) {
    return min(x, dims[0], k).values;
  };
  const ReduceFn amax_fn = [](const Tensor& x, const Dims& dims, bool k) {
    return amax(x, dims, k);
  };
  const ReduceFn amin_fn = [](const Tensor& x, const Dims& dims, bool k) {
    return amin(x, dims, k);
  };
  const ReduceFn argmax_fn = [](const Tensor& x, const Dims& dims, bool k) {
    return argmax(x, dims[0], k);
  };
  const ReduceFn argmin_fn = [](const Tensor& x, const Dims& dims, bool k) {
    return argmin(x, dims[0], k);
  };
  for (bool keep : {false, true}) {
    run_case(reduce_case("max", max_dim, r_max, {3, 4, 5}, {1}, keep, d, {0, 4}));
    run_case(reduce_case("min", min_dim, r_min, {3, 4, 5}, {-1}, keep, d, {0, 4}));
    run_case(reduce_case("amax", amax_fn, r_max, {3, 4, 5}, {0, 2}, keep, d, {3, 0, 2}));
    run_case(reduce_case("amin", amin_fn, r_min, {3, 4}, {1}, keep, d, {0, 4}));
    OpCase am = reduce_case("argmax", argmax_fn, r_argmax, {4, 5}, {0}, keep, d, {4, 0});
    am.grad = false;
    run_case(am);
    OpCase an = reduce_case("argmin", argmin_fn, r_argmin, {3, 4, 5}, {-1}, keep, d, {0, 5});
    an.grad = false;
    run_case(an);
  }
  const ReduceFn max_all = [](const Tensor& x, const Dims&, bool) { return max(x); };
  const ReduceFn min_all = [](const Tensor& x, const Dims&, bool) { return min(x); };
  run_case(reduce_case("max (whole tensor)", max_all, r_max, {3, 4}, {}, false, d));
  run_case(reduce_case("min (whole tensor)", min_all, r_min, {3, 4}, {}, false, d));
}

TEST_CASE("var, std and logsumexp through the harness") {
  for (double corr : {1.0, 0.0}) {
    const std::string c = corr == 1.0 ? " (correction 1)" : " (correction 0)";
    const ReduceFn var_fn = [corr](const Tensor& x, const Dims& dims, bool k) {
      return var(x, dims, corr, k);
    };
    const ReduceFn std_fn = [corr](const Tensor& x, const Dims& dims, bool k) {
      return quanta::std(x, dims, corr, k);
    };
    const RowFn r_v = r_var(corr, false), r_s = r_var(corr, true);
    run_case(reduce_case("var" + c, var_fn, r_v, {3, 4}, {1}, false, Domain::any, {0, 4}));
    run_case(reduce_case("var" + c, var_fn, r_v, {3, 4, 5}, {0, -1}, true, Domain::any, {3, 0, 2}));
    run_case(reduce_case("std" + c, std_fn, r_s, {3, 4}, {}, false));
    run_case(reduce_case("std" + c, std_fn, r_s, {5, 3}, {0}, true, Domain::any, {5, 0}));
  }
  const ReduceFn lse = [](const Tensor& x, const Dims& dims, bool k) {
    return logsumexp(x, dims, k);
  };
  run_case(reduce_case("logsumexp", lse, r_logsumexp, {3, 4}, {1}, false, Domain::any, {3, 0}));
  run_case(
      reduce_case("logsumexp", lse, r_logsumexp, {3, 4, 5}, {0, 2}, true, Domain::any, {0, 4, 5}));
}

TEST_CASE("norm through the harness") {
  auto norm_p = [](double p) -> ReduceFn {
    return [p](const Tensor& x, const Dims& dims, bool k) { return norm(x, p, dims, k); };
  };
  const Domain away = Domain::away_from_zero;
  run_case(reduce_case("norm p=1", norm_p(1), r_norm(1), {3, 4}, {1}, false, away, {3, 0}));
  run_case(reduce_case("norm p=2", norm_p(2), r_norm(2), {3, 4}, {}, false));
  run_case(reduce_case("norm p=2", norm_p(2), r_norm(2), {3, 4, 5}, {0, 2}, true, Domain::any,
                       {3, 0, 2}));
  run_case(reduce_case("norm p=inf", norm_p(INFINITY), r_norm(INFINITY), {3, 4}, {-1}, false,
                       Domain::distinct, {0, 4}));
  run_case(reduce_case("norm p=3", norm_p(3), r_norm(3), {3, 4}, {0}, false, away, {0, 4}));
}

TEST_CASE("cumsum, softmax and log_softmax through the harness") {
  auto ref_cumsum = [](const Values& v) {
    Values r(v.size());
    std::partial_sum(v.begin(), v.end(), r.begin());
    return r;
  };
  auto ref_softmax = [](const Values& v) {
    double s = 0;
    for (double a : v) s += std::exp(a);
    Values r;
    for (double a : v) r.push_back(std::exp(a) / s);
    return r;
  };
  auto ref_log_softmax = [](const Values& v) {
    double s = 0;
    for (double a : v) s += std::exp(a);
    Values r;
    for (double a : v) r.push_back(a - std::log(s));
    return r;
  };
  auto cs = [](const Tensor& x, int64_t d) { return cumsum(x, d); };
  auto sm = [](const Tensor& x, int64_t d) { return softmax(x, d); };
  auto lsm = [](const Tensor& x, int64_t d) { return log_softmax(x, d); };
  run_case(along_case("cumsum dim 0", {3, 4, 5}, 0, cs, ref_cumsum, {0, 4}));
  run_case(along_case("cumsum dim 1", {3, 4, 5}, 1, cs, ref_cumsum, {3, 0, 2}));
  run_case(along_case("cumsum dim -1", {3, 4}, -1, cs, ref_cumsum, {3, 0}));
  run_case(along_case("softmax dim -1", {3, 4}, -1, sm, ref_softmax, {0, 4}));
  run_case(along_case("softmax dim 1", {3, 4, 5}, 1, sm, ref_softmax, {2, 0, 3}));
  run_case(along_case("softmax dim 0", {3, 4}, 0, sm, ref_softmax, {3, 0}));
  run_case(along_case("log_softmax dim -1", {3, 4}, -1, lsm, ref_log_softmax, {0, 4}));
  run_case(along_case("log_softmax dim 1", {3, 4, 5}, 1, lsm, ref_log_softmax, {2, 0, 3}));
  run_case(along_case("log_softmax dim 0", {3, 4}, 0, lsm, ref_log_softmax, {3, 0}));
}

TEST_CASE("all and any through the harness") {
  const ReduceFn all_fn = [](const Tensor& x, const Dims& d, bool k) { return all(x, d, k); };
  const ReduceFn any_fn = [](const Tensor& x, const Dims& d, bool k) { return any(x, d, k); };
  const RowFn r_all = [](const Values& v) {
    return std::all_of(v.begin(), v.end(), [](double a) { return a != 0; });
  };
  const RowFn r_any = [](const Values& v) {
    return std::any_of(v.begin(), v.end(), [](double a) { return a != 0; });
  };
  for (bool keep : {false, true}) {
    for (OpCase c :
         {reduce_case("all", all_fn, r_all, {3, 4}, {1}, keep, Domain::any, {3, 0}),
          reduce_case("any", any_fn, r_any, {3, 4, 2}, {0, 2}, keep, Domain::any, {0, 4, 2})}) {
      c.inputs = {spec(bool_input)};
      c.grad = false;
      run_case(c);
    }
  }
}

TEST_CASE("empty reductions: identities where they exist, errors naming the op otherwise") {
  const Tensor e = zeros({3, 0});
  CHECK(prod(e, {1}).shape() == Shape{3});
  CHECK(vals(prod(e, {1})) == std::vector<double>{1, 1, 1});
  CHECK(prod(zeros({0})).item() == 1.0);
  CHECK(vals(all(e, {1})) == std::vector<double>{1, 1, 1});
  CHECK(vals(any(e, {1})) == std::vector<double>{0, 0, 0});
  CHECK(all(zeros({0})).item() == 1.0);
  CHECK(any(zeros({0})).item() == 0.0);
  CHECK(vals(norm(e, 2, {1})) == std::vector<double>{0, 0, 0});
  CHECK(vals(norm(e, 1, {1})) == std::vector<double>{0, 0, 0});
  CHECK(vals(logsumexp(e, {1})) == std::vector<double>{-INFINITY, -INFINITY, -INFINITY});
  CHECK(vals(cumsum(e, 1)).empty());
  CHECK(std::isnan(var(zeros({0})).item()));
  CHECK(std::isnan(quanta::std(zeros({0}), {}, 0.0).item()));
  // Reducing over a non-empty dim of an empty tensor is fine.
  CHECK(max(zeros({0, 3}), 1).values.shape() == Shape{0});
  CHECK(amax(zeros({0, 3}), {1}, true).shape() == Shape{0, 1});

  auto no_identity = [](const std::function<void()>& f, const char* op) {
    const std::string want = std::string("[") + op + "] cannot reduce";
    CHECK_THROWS_WITH_AS(f(), doctest::Contains(want.c_str()), std::invalid_argument);
  };
  no_identity([&] { max(e, 1); }, "max");
  no_identity([&] { min(e, -1, true); }, "min");
  no_identity([&] { max(zeros({0})); }, "max");
  no_identity([&] { min(zeros({2, 0})); }, "min");
  no_identity([&] { amax(e, {1}); }, "amax");
  no_identity([&] { amin(e); }, "amin");
  no_identity([&] { argmax(e, 1); }, "argmax");
  no_identity([&] { argmin(zeros({0, 2}), 0); }, "argmin");
  no_identity([&] { norm(e, INFINITY, {1}); }, "norm");
}

TEST_CASE("var and std with fewer values than the correction give NaN") {
  const Tensor x = t64({1, 2, 4}, {3, 1});
  for (double v : vals(var(x, {1}))) CHECK(std::isnan(v));
  for (double v : vals(quanta::std(x, {1}))) CHECK(std::isnan(v));
  CHECK(vals(var(x, {1}, 0.0)) == std::vector<double>{0, 0, 0});
  CHECK(var(x).item() == doctest::Approx(7.0 / 3.0));
  CHECK(var(x, {}, 0.0).item() == doctest::Approx(14.0 / 9.0));
  CHECK(var(x, {}, 2.0).item() == doctest::Approx(14.0 / 3.0));
}

TEST_CASE("max/min along a dim: first index on ties, gradient to that index only") {
  const Tensor x = t64({1, 3, 3, 2, 0, 0}, {2, 3}).requires_grad_();
  auto mx = max(x, 1);
  CHECK(mx.indices.dtype() == DType::i64);
  CHECK(vals(mx.values) == std::vector<double>{3, 2});
  CHECK(vals(mx.indices) == std::vector<double>{1, 0});
  sum(mx.values).backward();
  CHECK(vals(x.grad()) == std::vector<double>{0, 1, 0, 1, 0, 0});
  x.zero_grad();
  auto mn = min(x, -1, true);
  CHECK(mn.values.shape() == Shape{2, 1});
  CHECK(vals(mn.indices) == std::vector<double>{0, 1});
  sum(mn.values).backward();
  CHECK(vals(x.grad()) == std::vector<double>{1, 0, 0, 0, 1, 0});
  CHECK(vals(argmax(x, 1)) == std::vector<double>{1, 0});
  CHECK(vals(argmin(x, 1)) == std::vector<double>{0, 1});
  CHECK(argmax(x, 0, true).shape() == Shape{1, 3});
}

TEST_CASE("amax/amin and whole-tensor max/min split the gradient evenly among ties") {
  const Tensor x = t64({1, 3, 3, 2, 3, 0}, {2, 3}).requires_grad_();
  max(x).backward();
  CHECK(vals(x.grad()) == std::vector<double>{0, 1.0 / 3, 1.0 / 3, 0, 1.0 / 3, 0});
  x.zero_grad();
  sum(amax(x, {1})).backward();
  CHECK(vals(x.grad()) == std::vector<double>{0, 0.5, 0.5, 0, 1, 0});
  x.zero_grad();
  const Tensor y = t64({2, 2, 5, 2}).requires_grad_();
  min(y).backward();
  CHECK(vals(y.grad()) == std::vector<double>{1.0 / 3, 1.0 / 3, 0, 1.0 / 3});
  CHECK(min(y).item() == 2.0);
  CHECK(amin(y, {0}, true).shape() == Shape{1});
}

TEST_CASE("max and argmax propagate NaN like PyTorch") {
  const Tensor x = t64({1, NAN, 5, NAN}, {1, 4});
  auto m = max(x, 1);
  CHECK(std::isnan(m.values.item()));
  CHECK(m.indices.item() == 1.0);
  CHECK(std::isnan(amax(x).item()));
  CHECK(argmin(x, 1).item() == 1.0);
}

TEST_CASE("extrema keep integer, bool and 16-bit dtypes") {
  const Tensor i = from_vector<int32_t>({4, -2, 9, 9}, {2, 2});
  auto m = max(i, 1);
  CHECK(m.values.dtype() == DType::i32);
  CHECK(vals(m.values) == std::vector<double>{4, 9});
  CHECK(vals(m.indices) == std::vector<double>{0, 0});
  CHECK(amin(i).item() == -2.0);
  const Tensor b = from_vector<bool>({false, true, false}, {3});
  CHECK(max(b).dtype() == DType::boolean);
  CHECK(max(b).item() == 1.0);
  CHECK(argmax(b, 0).item() == 1.0);
  const Tensor h = t64({0.5, -1.5, 2.25}).to(DType::bf16);
  CHECK(amax(h).dtype() == DType::bf16);
  CHECK(amax(h).item() == 2.25);
  CHECK(prod(from_vector<int32_t>({2, 3, 4})).dtype() == DType::i64);
  CHECK(prod(from_vector<int32_t>({2, 3, 4})).item() == 24.0);
  CHECK(cumsum(from_vector<bool>({true, false, true}), 0).dtype() == DType::i64);
  const Tensor running = cumsum(from_vector<bool>({true, false, true}), 0);
  CHECK(vals(running) == std::vector<double>{1, 1, 2});
}

TEST_CASE("prod gradient is exact with zeros in the input") {
  const Tensor x = t64({2, 0, 3, 0, 0, 3, 2, 4, 5}, {3, 3}).requires_grad_();
  sum(prod(x, {1})).backward();
  // Row 0: one zero gets the product of the others; row 1: two zeros, all 0;
  // row 2: no zeros, prod / x.
  CHECK(vals(x.grad()) == std::vector<double>{0, 6, 0, 0, 0, 0, 20, 10, 8});
}

TEST_CASE("logsumexp is stable and never NaN for -inf rows") {
  const Tensor x = t64({1000, 1000, -INFINITY, -INFINITY, -INFINITY, 0}, {3, 2}).requires_grad_();
  const Tensor y = logsumexp(x, {1});
  const auto v = vals(y);
  CHECK(v[0] == doctest::Approx(1000 + std::log(2.0)));
  CHECK(v[1] == -INFINITY);
  CHECK(v[2] == 0.0);
  sum(y).backward();
  const auto g = vals(x.grad());
  CHECK(g[0] == doctest::Approx(0.5));
  CHECK(g[1] == doctest::Approx(0.5));
  CHECK(std::vector<double>(g.begin() + 2, g.end()) == std::vector<double>{0, 0, 0, 1});
  CHECK(logsumexp(t64({INFINITY, 1})).item() == INFINITY);
  CHECK(std::isnan(logsumexp(t64({NAN, 1})).item()));
  CHECK(logsumexp(from_vector<int64_t>({0, 0})).dtype() == DType::f32);
}

TEST_CASE("norm and std have a zero gradient where they are zero") {
  const Tensor x = zeros({2, 3}, {.dtype = DType::f64}).requires_grad_();
  sum(norm(x, 2, {1})).backward();
  CHECK(vals(x.grad()) == std::vector<double>(6, 0.0));
  x.zero_grad();
  sum(quanta::std(x, {1})).backward();
  CHECK(vals(x.grad()) == std::vector<double>(6, 0.0));
  x.zero_grad();
  sum(norm(x, 1, {1})).backward();  // sign(0) = 0, like PyTorch
  CHECK(vals(x.grad()) == std::vector<double>(6, 0.0));
  const Tensor y = t64({3, -4}).requires_grad_();
  CHECK(norm(y).item() == 5.0);
  CHECK(norm(y, 1).item() == 7.0);
  CHECK(norm(y, INFINITY).item() == 4.0);
  norm(y).backward();
  CHECK(vals(y.grad()) == std::vector<double>{0.6, -0.8});
  y.zero_grad();
  norm(y, INFINITY).backward();
  CHECK(vals(y.grad()) == std::vector<double>{0, -1});
}

TEST_CASE("cumsum backward is the reversed cumsum") {
  const Tensor x = t64({1, 2, 3, 4, 5, 6}, {2, 3}).requires_grad_();
  const Tensor y = cumsum(x, 1);
  CHECK(vals(y) == std::vector<double>{1, 3, 6, 4, 9, 15});
  y.backward(t64({1, 10, 100, 1, 2, 3}, {2, 3}));
  CHECK(vals(x.grad()) == std::vector<double>{111, 110, 100, 6, 5, 3});
  CHECK(vals(cumsum(x, 0)) == std::vector<double>{1, 2, 3, 5, 7, 9});
}

TEST_CASE("softmax and log_softmax are stable and use their own backward") {
  const Tensor x = t64({1000, 1001, 1002, -1000, 0, 1000}, {2, 3}).requires_grad_();
  const auto p = vals(softmax(x, 1));
  const double z = 1 + std::exp(-1.0) + std::exp(-2.0);
  CHECK(p[0] == doctest::Approx(std::exp(-2.0) / z));
  CHECK(p[2] == doctest::Approx(1 / z));
  CHECK(p[5] == doctest::Approx(1.0));
  CHECK(p[3] == 0.0);
  const auto l = vals(log_softmax(x, 1));
  CHECK(l[2] == doctest::Approx(-std::log(z)));
  CHECK(l[3] == doctest::Approx(-2000));
  // Rows of a softmax sum to 1, so the gradient of sum(softmax) is 0.
  sum(softmax(x, -1)).backward();
  for (double g : vals(x.grad())) CHECK(g == doctest::Approx(0.0));
  CHECK(softmax(from_vector<int64_t>({1, 1}), 0).dtype() == DType::f32);
  const Tensor h = softmax(t64({0, 1, 2, 3}).to(DType::bf16), 0);
  CHECK(h.dtype() == DType::bf16);
  CHECK(sum(h.to(DType::f32)).item() == doctest::Approx(1.0).epsilon(1e-2));
  // All -inf rows give NaN, like PyTorch (there is no distribution to return).
  for (double v : vals(softmax(t64({-INFINITY, -INFINITY}), 0))) CHECK(std::isnan(v));
}

TEST_CASE("0-d inputs reduce over nothing and accept dims 0 and -1") {
  const Tensor s = scalar(3.0, {.dtype = DType::f64}).requires_grad_();
  CHECK(prod(s).item() == 3.0);
  CHECK(sum(s, {0}).item() == 3.0);
  CHECK(sum(s, {-1}, true).shape() == Shape{});
  CHECK(mean(s, {0}).item() == 3.0);
  CHECK(prod(s, {0}).shape() == Shape{});
  auto m = max(s, -1);
  CHECK(m.values.item() == 3.0);
  CHECK(m.indices.item() == 0.0);
  CHECK(argmin(s, 0).shape() == Shape{});
  CHECK(amax(s, {0}, true).shape() == Shape{});
  CHECK(var(s, {}, 0.0).item() == 0.0);
  CHECK(logsumexp(s, {0}).item() == 3.0);
  CHECK(norm(s, 2, {-1}).item() == 3.0);
  CHECK(cumsum(s, 0).item() == 3.0);
  CHECK(softmax(s, 0).item() == 1.0);
  CHECK(any(s, {0}).item() == 1.0);
  m.values.backward();
  CHECK(s.grad().item() == 1.0);
  CHECK_THROWS_AS(prod(s, {1}), std::invalid_argument);
  CHECK_THROWS_AS(max(s, 1), std::invalid_argument);
}

TEST_CASE("reductions reject bad dtypes and dims, naming the op") {
  const Tensor i = from_vector<int64_t>({1, 2, 3});
  CHECK_THROWS_WITH_AS(var(i), doctest::Contains("[var] needs a floating tensor, got i64"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(quanta::std(i), doctest::Contains("[std]"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(norm(i), doctest::Contains("[norm] needs a floating tensor"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(norm(t64({1}), 0.0), doctest::Contains("[norm] p must be > 0"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(max(t64({1, 2}), 1), doctest::Contains("[max] dim 1 out of range"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(amax(zeros({2, 2}), {0, -2}), doctest::Contains("[amax]"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(cumsum(zeros({2}), 2), doctest::Contains("[cumsum]"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(softmax(zeros({2}), -2), doctest::Contains("[softmax]"),
                       std::invalid_argument);
}

namespace {

// Elementwise agreement of a CUDA result with the CPU's: same shape and
// dtype, NaN where the CPU has NaN, equal infinities, else within `tol`
// relative (exact for tol 0).
void check_device_result(const std::string& what, const Tensor& dev, const Tensor& cpu,
                         double tol) {
  INFO(what);
  CHECK(!dev.device().is_cpu());
  REQUIRE(dev.shape() == cpu.shape());
  REQUIRE(dev.dtype() == cpu.dtype());
  const Values g = vals(dev.to(Device::cpu())), w = vals(cpu);
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < w.size(); ++i) {
    const bool ok = std::isnan(w[i]) ? std::isnan(g[i])
                    : std::isinf(w[i])
                        ? g[i] == w[i]
                        : std::abs(g[i] - w[i]) <= tol * std::max(1.0, std::abs(w[i]));
    if (!ok && bad++ == 0) first = static_cast<int64_t>(i);
  }
  CHECK_MESSAGE(bad == 0, bad << " elements differ, first at " << first << ": cuda "
                              << (first >= 0 ? g[first] : 0.0) << ", cpu "
                              << (first >= 0 ? w[first] : 0.0));
}

}  // namespace

TEST_CASE("reductions and softmax on cuda match the cpu on long rows, ties and NaN") {
  if (!quanta::testing::have_gpu()) MESSAGE("cuda:0 skipped: " << quanta::testing::no_gpu_reason());
  for (const Device dev : quanta::testing::test_devices()) {
    INFO("on ", dev.str());
    // Rows longer than a block of threads and than one tile of the scan, in
    // every layout: reduced dim last (a block per row) and strided.
    const std::vector<Shape> shapes = {{3, 1000}, {1, 5000}, {1000, 3}, {2, 700, 3}};
    uint64_t seed = 40;
    for (const Shape& s : shapes) {
      for (DType dt : {DType::f64, DType::f32}) {
        const double tol = dt == DType::f64 ? 1e-9 : 1e-4;
        const Tensor smooth = make_input(s, Domain::any, ++seed).to(dt);
        // Few distinct values: many ties for the extrema; a few NaN rows.
        Tensor ties = round(make_input(s, Domain::any, ++seed) * 2.0);
        Values tv = vals(ties);
        for (size_t i = 500; i < tv.size(); i += 997) tv[i] = NAN;
        ties = from_vector<double>(tv, {static_cast<int64_t>(tv.size())}).reshape(s).to(dt);
        const Tensor near_one = add(smooth * 0.001, scalar(1.0, {.dtype = dt}));
        const Tensor flags = gt(smooth, scalar(1.9, {.dtype = dt}));
        for (int64_t d = 0; d < static_cast<int64_t>(s.size()); ++d) {
          const std::string at = shape_str(s) + " " + dtype_name(dt) + " dim " + std::to_string(d);
          for (const Tensor& x : {smooth, ties}) {
            const Tensor xd = x.to(dev);
            auto mx = max(xd, d), mx_cpu = max(x, d);
            check_device_result("max values " + at, mx.values, mx_cpu.values, 0);
            check_device_result("max indices " + at, mx.indices, mx_cpu.indices, 0);
            auto mn = min(xd, d, true), mn_cpu = min(x, d, true);
            check_device_result("min values " + at, mn.values, mn_cpu.values, 0);
            check_device_result("min indices " + at, mn.indices, mn_cpu.indices, 0);
            check_device_result("argmax " + at, argmax(xd, d), argmax(x, d), 0);
            check_device_result("amin " + at, amin(xd, {d}), amin(x, {d}), 0);
            check_device_result("logsumexp " + at, logsumexp(xd, {d}), logsumexp(x, {d}), tol);
            // A running sum's rounding grows along the row (f32: 5000 terms).
            check_device_result("cumsum " + at, cumsum(xd, d), cumsum(x, d),
                                dt == DType::f64 ? 1e-9 : 5e-3);
            check_device_result("softmax " + at, softmax(xd, d), softmax(x, d), tol);
            check_device_result("log_softmax " + at, log_softmax(xd, d), log_softmax(x, d), tol);
            check_device_result("var " + at, var(xd, {d}), var(x, {d}), tol);
            check_device_result("std " + at, quanta::std(xd, {d}, 0.0), quanta::std(x, {d}, 0.0),
                                tol);
            for (double p : {1.0, 2.0, 3.0, double(INFINITY)})
              check_device_result("norm p=" + std::to_string(p) + " " + at, norm(xd, p, {d}),
                                  norm(x, p, {d}), tol);
          }
          check_device_result("prod " + at, prod(near_one.to(dev), {d}), prod(near_one, {d}), tol);
          check_device_result("any " + at, any(flags.to(dev), {d}), any(flags, {d}), 0);
          check_device_result("all " + at, all(logical_not(flags).to(dev), {d}),
                              all(logical_not(flags), {d}), 0);
          // Integers: exact, products wrap as on the CPU.
          const Tensor ints = round(smooth * 3.0).to(DType::i32);
          check_device_result("cumsum i32 " + at, cumsum(ints.to(dev), d), cumsum(ints, d), 0);
          check_device_result("prod i32 " + at, prod(ints.to(dev), {d}), prod(ints, {d}), 0);
          check_device_result("max i32 " + at, max(ints.to(dev), d).indices, max(ints, d).indices,
                              0);
        }
      }
    }
    // The first NaN, else the first extremum.
    const Tensor x = t64({1, 5, 5, NAN, 2, NAN}, {1, 6});
    CHECK(max(x.to(dev), 1).indices.to(Device::cpu()).item() == 3.0);
    CHECK(argmax(t64({1, 5, 5, 2}).to(dev), 0).to(Device::cpu()).item() == 1.0);
    CHECK(argmin(t64({3, 1, 2, 1}).to(dev), 0).to(Device::cpu()).item() == 1.0);
  }
}

TEST_CASE("reductions over leading and middle dims read the input in place, as the rows do") {
  using detail::plan_reduce;
  const Tensor x4 = zeros({2, 3, 4, 5});
  // Which layouts are read in place (grid) and how; rows ([kept,] reduced)
  // need no copy either; anything else, or a strided input, is copied.
  auto p = plan_reduce(zeros({6, 7}), {0}, false, "sum", true);
  CHECK(p.use_grid);
  CHECK((p.grid.outer == 1 && p.grid.a == 6 && p.grid.keep == 7 && p.grid.b == 1));
  p = plan_reduce(x4, {1}, false, "sum", true);  // [kept, reduced, kept]
  CHECK((p.use_grid && p.grid.outer == 2 && p.grid.a == 3 && p.grid.keep == 20 && p.grid.b == 1));
  p = plan_reduce(x4, {0, 2, 3}, false, "sum", true);  // NCHW over N, H, W
  CHECK((p.use_grid && p.grid.outer == 1 && p.grid.a == 2 && p.grid.keep == 3 && p.grid.b == 20));
  p = plan_reduce(x4, {1, 3}, false, "sum", true);  // kept, reduced, kept, reduced
  CHECK((p.use_grid && p.grid.outer == 2 && p.grid.a == 3 && p.grid.keep == 4 && p.grid.b == 5));
  p = plan_reduce(zeros({8, 1, 6, 1, 3}), {0, 2}, false, "sum", true);  // size-1 dims merge
  CHECK((p.use_grid && p.grid.outer == 1 && p.grid.a == 48 && p.grid.keep == 3 && p.grid.b == 1));
  CHECK_FALSE(plan_reduce(x4, {2, 3}, false, "sum", true).use_grid);  // rows
  CHECK_FALSE(plan_reduce(x4, {}, false, "sum", true).use_grid);      // all: one row
  CHECK_FALSE(plan_reduce(x4, {0, 2}, false, "sum", true).use_grid);  // too many groups
  CHECK_FALSE(plan_reduce(x4, {0}, false, "sum", false).use_grid);    // op without a grid
  CHECK_FALSE(plan_reduce(transpose(x4, 0, 3), {3}, false, "sum", true).use_grid);  // strided
  CHECK_FALSE(plan_reduce(zeros({0, 4}), {0}, false, "sum", true).use_grid);        // empty

  // Every op with a grid reduction, on the CPU and each test device, against
  // the same values laid out strided (which reduce as rows after a copy):
  // bit for bit where the order cannot matter, within rounding for sums and
  // products. The shapes take every kernel branch: a long column cut into
  // pieces, few outputs, b long enough for a block per output, size-1 dims.
  struct Layout {
    Shape shape;
    Dims dims;
  };
  const std::vector<Layout> layouts = {{{4096, 48}, {0}},        {{3, 700, 5}, {1}},
                                       {{5, 7, 40}, {0, 2}},     {{5, 7, 3}, {0, -1}},
                                       {{2, 300, 4, 6}, {1, 3}}, {{8, 1, 600, 1, 3}, {0, 2}},
                                       {{20000, 2}, {0}},        {{70, 1100}, {0}}};
  std::vector<Device> devices{Device::cpu()};
  for (const Device d : quanta::testing::test_devices()) devices.push_back(d);
  uint64_t seed = 90;
  for (const Device dev : devices) {
    for (const Layout& l : layouts) {
      for (bool keep : {false, true}) {
        const std::string at = dev.str() + " " + shape_str(l.shape) + " dims " + shape_str(l.dims);
        INFO(at);
        const Tensor base = make_input(l.shape, Domain::any, ++seed);
        // A copy with the same values whose first and last dims are swapped
        // in memory: not contiguous, so its reductions go through the rows.
        const auto strided = [](const Tensor& t) {
          return transpose(contiguous(transpose(t, 0, -1)), 0, -1);
        };
        REQUIRE(plan_reduce(base, l.dims, keep, "sum", true).use_grid);
        for (DType dt : {DType::f64, DType::f32}) {
          const Tensor x = base.to(dt).to(dev), xs = strided(base.to(dt).to(dev));
          REQUIRE_FALSE(xs.is_contiguous());
          const double tol = dt == DType::f64 ? 1e-12 : 2e-5;
          const Tensor s = sum(x, l.dims, keep).to(Device::cpu()).to(DType::f64);
          const Tensor ss = sum(xs, l.dims, keep).to(Device::cpu()).to(DType::f64);
          REQUIRE(s.shape() == ss.shape());
          const Values sv = vals(s), ssv = vals(ss);
          const Values mag = vals(sum(abs(base), l.dims, keep));
          for (size_t i = 0; i < sv.size(); ++i) CHECK(std::abs(sv[i] - ssv[i]) <= tol * mag[i]);
          // Extrema with NaN in a few places: NaN wins, exactly the rows' answer.
          Values nv = vals(base);
          for (size_t i = 7; i < nv.size(); i += 1013) nv[i] = NAN;
          const Tensor n =
              from_vector<double>(nv, {static_cast<int64_t>(nv.size())}).reshape(l.shape).to(dt);
          for (bool is_max : {true, false}) {
            const Tensor g = is_max ? amax(n.to(dev), l.dims, keep) : amin(n.to(dev), l.dims, keep);
            const Tensor r = is_max ? amax(strided(n.to(dev)), l.dims, keep)
                                    : amin(strided(n.to(dev)), l.dims, keep);
            const Values gv = vals(g.to(Device::cpu())), rv = vals(r.to(Device::cpu()));
            for (size_t i = 0; i < gv.size(); ++i)
              CHECK(((std::isnan(gv[i]) && std::isnan(rv[i])) || gv[i] == rv[i]));
          }
          const Tensor near_one = add(base * 0.0005, scalar(1.0)).to(dt);
          const Values pv = vals(prod(near_one.to(dev), l.dims, keep).to(Device::cpu()));
          const Values prv = vals(prod(strided(near_one.to(dev)), l.dims, keep).to(Device::cpu()));
          for (size_t i = 0; i < pv.size(); ++i)
            CHECK(pv[i] == doctest::Approx(prv[i]).epsilon(dt == DType::f64 ? 1e-12 : 1e-4));
        }
        // Integers and bools: exact. Products wrap as unsigned 64-bit.
        const Tensor ints = round(base * 3.0).to(DType::i32);
        CHECK(vals(sum(ints.to(dev), l.dims, keep).to(Device::cpu())) ==
              vals(sum(strided(ints.to(dev)), l.dims, keep).to(Device::cpu())));
        CHECK(vals(amin(ints.to(dev), l.dims, keep).to(Device::cpu())) ==
              vals(amin(strided(ints.to(dev)), l.dims, keep).to(Device::cpu())));
        CHECK(prod(ints.to(dev), l.dims, keep).to(Device::cpu()).to_vector<int64_t>() ==
              prod(strided(ints.to(dev)), l.dims, keep).to(Device::cpu()).to_vector<int64_t>());
        const Tensor flags = gt(base, scalar(1.5));
        CHECK(vals(any(flags.to(dev), l.dims, keep).to(Device::cpu())) ==
              vals(any(strided(flags.to(dev)), l.dims, keep).to(Device::cpu())));
        CHECK(vals(all(logical_not(flags).to(dev), l.dims, keep).to(Device::cpu())) ==
              vals(all(strided(logical_not(flags).to(dev)), l.dims, keep).to(Device::cpu())));
      }
    }
  }
}

TEST_CASE("bf16 and f16 sums, amax and amin read the 16-bit input and reduce in f32") {
  // Every device's table reduces 16-bit rows and grids directly
  // (half_reductions): no widened copy of the input, f32 sums. Extrema are
  // exact; sums agree with the widened input's within the 16-bit result's
  // rounding (the order of the f32 sums is the device's).
  std::vector<Device> devices{Device::cpu()};
  for (const Device d : quanta::testing::test_devices()) devices.push_back(d);
  struct Layout {
    Shape shape;
    Dims dims;
  };
  const std::vector<Layout> layouts = {{{70000}, {}},         {{300, 70}, {1}}, {{300, 70}, {0}},
                                       {{6, 50, 40}, {0, 2}}, {{4, 9, 5}, {1}}, {{3, 5}, {}}};
  for (const Device dev : devices) {
    for (const DType dt : {DType::bf16, DType::f16}) {
      for (const Layout& l : layouts) {
        const std::string at =
            dev.str() + " " + dtype_name(dt) + " " + shape_str(l.shape) + " " + shape_str(l.dims);
        INFO(at);
        Values v = vals(make_input(l.shape, Domain::any, 81));
        for (size_t i = 11; i < v.size(); i += 4999) v[i] = NAN;
        const Tensor clean = make_input(l.shape, Domain::any, 82).to(dt).to(dev);
        const Tensor x = from_vector<double>(v, {static_cast<int64_t>(v.size())})
                             .reshape(l.shape)
                             .to(dt)
                             .to(dev);
        const Tensor s = sum(clean, l.dims), s32 = sum(clean.to(DType::f32), l.dims);
        CHECK(s.dtype() == dt);
        const Values sv = vals(s.to(Device::cpu())), s32v = vals(s32.to(Device::cpu()));
        const Values mag = vals(sum(abs(clean.to(DType::f32)), l.dims).to(Device::cpu()));
        for (size_t i = 0; i < sv.size(); ++i)
          CHECK(std::abs(sv[i] - s32v[i]) <= 1e-2 * std::abs(s32v[i]) + 1e-5 * mag[i]);
        for (bool is_max : {true, false}) {
          const Tensor e = is_max ? amax(x, l.dims) : amin(x, l.dims);
          const Tensor e32 =
              is_max ? amax(x.to(DType::f32), l.dims) : amin(x.to(DType::f32), l.dims);
          CHECK(e.dtype() == dt);
          const Values ev = vals(e.to(Device::cpu())), e32v = vals(e32.to(Device::cpu()));
          for (size_t i = 0; i < ev.size(); ++i)
            CHECK(((std::isnan(ev[i]) && std::isnan(e32v[i])) || ev[i] == e32v[i]));
        }
      }
    }
  }
  // No widened copy: a 16-bit sum records the reduction and the narrowing of
  // its small result, as many as an f32 sum records plus that one.
  const Tensor h = ones({64, 64}, {.dtype = DType::bf16, .device = Device::sim(0)});
  Tensor out;
  CHECK(DeviceGraph::capture(Device::sim(0), [&] { out = sum(h, {0}); }).recorded_work() == 2);
  CHECK(DeviceGraph::capture(Device::sim(0), [&] { out = amax(h, {1}); }).recorded_work() == 2);
  const Tensor f = ones({64, 64}, {.dtype = DType::f32, .device = Device::sim(0)});
  CHECK(DeviceGraph::capture(Device::sim(0), [&] { out = sum(f, {0}); }).recorded_work() == 1);
}
