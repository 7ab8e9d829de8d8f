// Op-harness rows for the losses, one_hot, layer_norm and group_norm, plus
// hand-computed cross-entropy values (ignore_index, label smoothing) and errors.
#include <doctest/doctest.h>

#include <cmath>

#include "engine/ops/harness.h"
#include "support/gpu.h"
#include "support/numeric_grad.h"
#include "support/relative_error.h"

using namespace quanta;
using namespace quanta::testing;

namespace {

using Values = std::vector<double>;

const char* reduction_name(Reduction r) {
  return r == Reduction::none ? "none" : r == Reduction::sum ? "sum" : "mean";
}

// i64 class indices in [0, classes); every third one is `ignore` when asked.
std::function<Tensor(const Shape&, uint64_t)> class_targets(int64_t classes, bool with_ignore,
                                                            int64_t ignore = -100) {
  return [=](const Shape& shape, uint64_t seed) {
    const int64_t n = numel_of(shape);
    std::vector<int64_t> v(static_cast<size_t>(n));
    uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
    for (int64_t i = 0; i < n; ++i) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      v[i] = static_cast<int64_t>((s >> 33) % static_cast<uint64_t>(classes));
      if (with_ignore && i % 3 == 1) v[i] = ignore;
    }
    return from_vector<int64_t>(v, n ? Shape{n} : Shape{0}).reshape(shape);
  };
}

Tensor reduce_ref(const Values& losses, const Shape& shape, Reduction r, double count) {
  double total = 0;
  for (double l : losses) total += l;
  if (r == Reduction::sum) return scalar(total, {.dtype = DType::f64});
  if (r == Reduction::mean) return scalar(total / count, {.dtype = DType::f64});
  const int64_t n = static_cast<int64_t>(losses.size());
  return from_vector<double>(losses, n ? Shape{n} : Shape{0}).reshape(shape);
}

// Plain-loop cross entropy: logits [N, C, *]; target either class indices
// [N, *] or probabilities [N, C, *].
Tensor ref_cross_entropy(const Tensor& logits, const Tensor& target, Reduction r, int64_t ignore,
                         double eps) {
  const Shape& ls = logits.shape();
  const int64_t n = ls[0], c = ls[1], inner = numel_of(ls) / std::max<int64_t>(n * c, 1);
  const Values x = logits.to_vector<double>(), t = target.to_vector<double>();
  const bool probs = is_floating(target.dtype());
  Values losses;
  double count = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t s = 0; s < inner; ++s) {
      auto at = [&](int64_t k) { return x[(i * c + k) * inner + s]; };
      double lse = 0, mean_x = 0;
      for (int64_t k = 0; k < c; ++k) lse += std::exp(at(k));
      lse = std::log(lse);
      for (int64_t k = 0; k < c; ++k) mean_x += at(k) / static_cast<double>(c);
      if (probs) {
        double l = 0;
        for (int64_t k = 0; k < c; ++k) {
          const double q = (1 - eps) * t[(i * c + k) * inner + s] + eps / static_cast<double>(c);
          l -= q * (at(k) - lse);
        }
        losses.push_back(l);
        count += 1;
        continue;
      }
      const auto cls = static_cast<int64_t>(t[i * inner + s]);
      if (cls == ignore) {
        losses.push_back(0);
        continue;
      }
      losses.push_back((1 - eps) * (lse - at(cls)) + eps * (lse - mean_x));
      count += 1;
    }
  return reduce_ref(losses, target.shape(), r, count);
}

OpCase ce_case(Shape logits, Shape target, Reduction r, bool with_ignore, double eps = 0.0,
               Shape zero_logits = {}, Shape zero_target = {}, int64_t ignore = -100) {
  OpCase c;
  c.name = std::string("cross_entropy ") + shape_str(logits) + " " + reduction_name(r) +
           (with_ignore ? " ignore_index " + std::to_string(ignore) : "") +
           (eps > 0 ? " smoothing " + std::to_string(eps) : "");
  const int64_t classes = logits[1];
  c.shapes = {std::move(logits), std::move(target)};
  if (!zero_logits.empty()) c.zero_shapes = {std::move(zero_logits), std::move(zero_target)};
  c.inputs = {spec(Domain::any), spec(class_targets(classes, with_ignore, ignore))};
  c.op = [=](const Inputs& x) { return cross_entropy(x[0], x[1], r, ignore, eps); };
  c.reference = [=](const Inputs& x) { return ref_cross_entropy(x[0], x[1], r, ignore, eps); };
  return c;
}

OpCase pair_loss_case(const char* name,
                      std::function<Tensor(const Tensor&, const Tensor&, Reduction)> op,
                      std::function<double(double)> f, Reduction r) {
  OpCase c;
  c.name = std::string(name) + " " + reduction_name(r);
  c.shapes = {{3, 4}, {3, 4}};
  c.zero_shapes = {{0, 4}, {0, 4}};
  // b sits below a, so |a - b| stays away from the kink of l1 at 0.
  c.inputs = {spec(Domain::positive), spec([](const Shape& s, uint64_t seed) {
                return neg(make_input(s, Domain::positive, seed));
              })};
  c.op = [=](const Inputs& x) { return op(x[0], x[1], r); };
  c.reference = [=](const Inputs& x) {
    const Values a = x[0].to_vector<double>(), b = x[1].to_vector<double>();
    Values l;
    for (size_t i = 0; i < a.size(); ++i) l.push_back(f(a[i] - b[i]));
    return reduce_ref(l, x[0].shape(), r, static_cast<double>(l.size()));
  };
  return c;
}

// Plain-loop standardisation of groups of `group` consecutive values (in the
// layout of x viewed as [outer, group]) with per-position affine parameters
// looked up by `param_index(flat index)`.
Tensor ref_normalize(const Tensor& x, int64_t group, const Tensor& w, const Tensor& b,
                     const std::function<int64_t(int64_t)>& param_index, double eps) {
  const Values v = x.to_vector<double>();
  const Values wv = w.defined() ? w.to_vector<double>() : Values{};
  const Values bv = b.defined() ? b.to_vector<double>() : Values{};
  Values out(v.size());
  for (size_t g0 = 0; g0 < v.size(); g0 += static_cast<size_t>(group)) {
    double m = 0, ss = 0;
    for (int64_t k = 0; k < group; ++k) m += v[g0 + k] / static_cast<double>(group);
    for (int64_t k = 0; k < group; ++k) ss += (v[g0 + k] - m) * (v[g0 + k] - m);
    const double inv = 1 / std::sqrt(ss / static_cast<double>(group) + eps);
    for (int64_t k = 0; k < group; ++k) {
      const int64_t i = static_cast<int64_t>(g0) + k;
      double y = (v[i] - m) * inv;
      if (!wv.empty()) y *= wv[param_index(i)];
      if (!bv.empty()) y += bv[param_index(i)];
      out[i] = y;
    }
  }
  const int64_t n = x.numel();
  return from_vector<double>(out, n ? Shape{n} : Shape{0}).reshape(x.shape());
}

OpCase layer_norm_case(Shape x, Shape normalized, bool affine, Shape zero_x = {}) {
  OpCase c;
  c.name =
      "layer_norm " + shape_str(x) + " over " + shape_str(normalized) + (affine ? " affine" : "");
  c.shapes = {x};
  if (affine) c.shapes.insert(c.shapes.end(), {normalized, normalized});
  if (!zero_x.empty()) {
    c.zero_shapes = {zero_x};
    if (affine) c.zero_shapes.insert(c.zero_shapes.end(), {normalized, normalized});
  }
  c.op = [=](const Inputs& in) {
    return affine ? layer_norm(in[0], normalized, in[1], in[2]) : layer_norm(in[0], normalized);
  };
  c.reference = [=](const Inputs& in) {
    const int64_t group = numel_of(normalized);
    return ref_normalize(
        in[0], group, affine ? in[1] : Tensor(), affine ? in[2] : Tensor(),
        [group](int64_t i) { return i % group; }, 1e-5);
  };
  return c;
}

OpCase group_norm_case(Shape x, int64_t groups, bool affine, Shape zero_x = {}) {
  OpCase c;
  const int64_t channels = x[1];
  c.name = "group_norm " + shape_str(x) + " groups " + std::to_string(groups) +
           (affine ? " affine" : "");
  c.shapes = {x};
  if (affine) c.shapes.insert(c.shapes.end(), {{channels}, {channels}});
  if (!zero_x.empty()) {
    c.zero_shapes = {zero_x};
    if (affine) c.zero_shapes.insert(c.zero_shapes.end(), {{channels}, {channels}});
  }
  c.op = [=](const Inputs& in) {
    return affine ? group_norm(in[0], groups, in[1], in[2]) : group_norm(in[0], groups);
  };
  c.reference = [=](const Inputs& in) {
    const Shape& s = in[0].shape();
    const int64_t spatial = numel_of(s) / std::max<int64_t>(s[0] * s[1], 1);
    return ref_normalize(
        in[0], channels / groups * spatial, affine ? in[1] : Tensor(), affine ? in[2] : Tensor(),
        [=](int64_t i) { return (i / spatial) % channels; }, 1e-5);
  };
  return c;
}

Tensor t64(Values v, Shape shape = {}) {
  if (shape.empty()) shape = {static_cast<int64_t>(v.size())};
  return from_vector<double>(v, shape);
}
Tensor i64(std::vector<int64_t> v, Shape shape = {}) {
  if (shape.empty()) shape = {static_cast<int64_t>(v.size())};
  return from_vector<int64_t>(v, shape);
}
Values vals(const Tensor& t) { return t.to_vector<double>(); }

}  // namespace

TEST_CASE("cross_entropy through the harness") {
  for (Reduction r : {Reduction::none, Reduction::mean, Reduction::sum}) {
    run_case(ce_case({5, 4}, {5}, r, false, 0.0, {0, 4}, {0}));
    run_case(ce_case({6, 3}, {6}, r, true, 0.0, {0, 3}, {0}));
    run_case(ce_case({5, 4}, {5}, r, true, 0.1));
    run_case(ce_case({2, 3, 2, 2}, {2, 2, 2}, r, true, 0.2, {2, 3, 0, 2}, {2, 0, 2}));
  }
  // An ignore_index inside the class range drops that class's targets.
  run_case(ce_case({6, 3}, {6}, Reduction::mean, true, 0.0, {}, {}, 1));

  OpCase probs;
  probs.name = "cross_entropy with probability targets and smoothing";
  probs.shapes = {{4, 3, 2}, {4, 3, 2}};
  probs.zero_shapes = {{0, 3}, {0, 3}};
  probs.inputs = {spec(Domain::any), spec(Domain::positive)};
  probs.op = [](const Inputs& x) { return cross_entropy(x[0], x[1], Reduction::mean, -100, 0.1); };
  probs.reference = [](const Inputs& x) {
    return ref_cross_entropy(x[0], x[1], Reduction::mean, -100, 0.1);
  };
  run_case(probs);
}

TEST_CASE("mse_loss and l1_loss through the harness") {
  for (Reduction r : {Reduction::none, Reduction::mean, Reduction::sum}) {
    run_case(pair_loss_case(
        "mse_loss", [](auto& a, auto& b, Reduction r) { return mse_loss(a, b, r); },
        [](double d) { return d * d; }, r));
    run_case(pair_loss_case(
        "l1_loss", [](auto& a, auto& b, Reduction r) { return l1_loss(a, b, r); },
        [](double d) { return std::abs(d); }, r));
  }
}

TEST_CASE("layer_norm and group_norm through the harness") {
  run_case(layer_norm_case({3, 4, 5}, {5}, true, {0, 4, 5}));
  run_case(layer_norm_case({3, 4, 5}, {4, 5}, true));
  run_case(layer_norm_case({2, 6}, {6}, false, {0, 6}));
  run_case(group_norm_case({2, 4, 3}, 2, true, {0, 4, 3}));
  run_case(group_norm_case({2, 6, 2, 2}, 3, true));
  run_case(group_norm_case({3, 4}, 4, false, {0, 4}));
  run_case(group_norm_case({2, 4, 3}, 1, false));
}

TEST_CASE("one_hot through the harness") {
  OpCase c;
  c.name = "one_hot";
  c.shapes = {{3, 4}};
  c.zero_shapes = {{0, 4}};
  c.grad = false;
  c.inputs = {spec(class_targets(5, false))};
  c.op = [](const Inputs& x) { return one_hot(x[0], 5); };
  c.reference = [](const Inputs& x) {
    const Values v = x[0].to_vector<double>();
    Values out(v.size() * 5, 0.0);
    for (size_t i = 0; i < v.size(); ++i) out[i * 5 + static_cast<size_t>(v[i])] = 1;
    Shape s = x[0].shape();
    s.push_back(5);
    const int64_t n = static_cast<int64_t>(out.size());
    return from_vector<double>(out, n ? Shape{n} : Shape{0}).reshape(s);
  };
  run_case(c);
}

TEST_CASE("cross_entropy matches hand-computed values") {
  // Row 0: logits 1, 2, 3, target 2; row 1: all equal, target 0.
  const Tensor logits = t64({1, 2, 3, 1, 1, 1}, {2, 3}).requires_grad_();
  const double lse0 = 3 + std::log(1 + std::exp(-1.0) + std::exp(-2.0));
  const double nll0 = lse0 - 3, nll1 = std::log(3.0);
  CHECK(cross_entropy(logits, i64({2, 0})).item() == doctest::Approx((nll0 + nll1) / 2));
  CHECK(cross_entropy(logits, i64({2, 0}), Reduction::sum).item() == doctest::Approx(nll0 + nll1));
  const Values none = vals(cross_entropy(logits, i64({2, 0}), Reduction::none));
  CHECK(none[0] == doctest::Approx(nll0));
  CHECK(none[1] == doctest::Approx(nll1));

  // ignore_index: the ignored sample adds 0 and does not count in the mean.
  CHECK(cross_entropy(logits, i64({2, -100})).item() == doctest::Approx(nll0));
  CHECK(vals(cross_entropy(logits, i64({2, -100}), Reduction::none))[1] == 0.0);
  CHECK(cross_entropy(logits, i64({2, 7}), Reduction::mean, 7).item() == doctest::Approx(nll0));
  CHECK(std::isnan(cross_entropy(logits, i64({-100, -100})).item()));
  CHECK(cross_entropy(logits, i64({-100, -100}), Reduction::sum).item() == 0.0);

  // Label smoothing 0.1: 0.9 nll + 0.1 (lse - mean of the logits).
  const double s0 = 0.9 * nll0 + 0.1 * (lse0 - 2), s1 = nll1;
  CHECK(cross_entropy(logits, i64({2, 0}), Reduction::mean, -100, 0.1).item() ==
        doctest::Approx((s0 + s1) / 2));
  CHECK(cross_entropy(logits, i64({2, -100}), Reduction::mean, -100, 0.1).item() ==
        doctest::Approx(s0));

  // Gradient of the mean: (softmax - one_hot) / N.
  cross_entropy(logits, i64({2, 0})).backward();
  const Values g = vals(logits.grad());
  CHECK(g[0] == doctest::Approx(std::exp(1 - lse0) / 2));
  CHECK(g[2] == doctest::Approx((std::exp(3 - lse0) - 1) / 2));
  CHECK(g[3] == doctest::Approx((1.0 / 3 - 1) / 2));
  CHECK(g[4] == doctest::Approx(1.0 / 6));
}

TEST_CASE("cross_entropy takes [C] logits with a 0-d target, and empty batches") {
  const Tensor logits = t64({1, 2, 3});
  const double lse = 3 + std::log(1 + std::exp(-1.0) + std::exp(-2.0));
  const Tensor target = from_vector<int64_t>({0}, {1}).reshape({});
  CHECK(cross_entropy(logits, target).item() == doctest::Approx(lse - 1));
  CHECK(cross_entropy(logits, target, Reduction::none).shape() == Shape{});
  const Tensor empty_logits = zeros({0, 4});
  const Tensor empty_target = zeros({0}, {.dtype = DType::i64});
  CHECK(std::isnan(cross_entropy(empty_logits, empty_target).item()));
  CHECK(cross_entropy(empty_logits, empty_target, Reduction::sum).item() == 0.0);
  CHECK(cross_entropy(empty_logits, empty_target, Reduction::none).shape() == Shape{0});
}

TEST_CASE("cross_entropy rejects bad targets with clear errors") {
  const Tensor logits = zeros({2, 3});
  CHECK_THROWS_WITH_AS(cross_entropy(logits, i64({0, 3})),
                       doctest::Contains("[cross_entropy] target 3 is out of range for 3 classes"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(cross_entropy(logits, i64({-1, 0})),
                       doctest::Contains("target -1 is out of range"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(cross_entropy(logits, i64({0, 1, 2})),
                       doctest::Contains("target shape [3] does not match logits shape [2, 3]"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(cross_entropy(zeros({2, 3, 4}), i64({0, 1})),
                       doctest::Contains("expected [2, 4]"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(cross_entropy(i64({0, 1}, {1, 2}), i64({0})),
                       doctest::Contains("logits must be floating"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(cross_entropy(logits, from_vector<bool>({true, false})),
                       doctest::Contains("target must hold i64 class indices"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(cross_entropy(logits, zeros({2, 4})),
                       doctest::Contains("probability target shape"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(cross_entropy(logits, i64({0, 1}), Reduction::mean, -100, 1.5),
                       doctest::Contains("label_smoothing"), std::invalid_argument);
}

TEST_CASE("mse_loss and l1_loss values and errors") {
  const Tensor a = t64({1, 2, 3, 4}, {2, 2}), b = t64({1, 0, 5, 1}, {2, 2});
  CHECK(mse_loss(a, b).item() == doctest::Approx((0 + 4 + 4 + 9) / 4.0));
  CHECK(mse_loss(a, b, Reduction::sum).item() == 17.0);
  CHECK(vals(l1_loss(a, b, Reduction::none)) == Values{0, 2, 2, 3});
  CHECK(l1_loss(a, b).item() == doctest::Approx(7 / 4.0));
  CHECK(std::isnan(mse_loss(zeros({0}), zeros({0})).item()));
  CHECK_THROWS_WITH_AS(
      mse_loss(zeros({2, 1}), zeros({2})),
      doctest::Contains("[mse_loss] input shape [2, 1] and target shape [2] differ"),
      std::invalid_argument);
  CHECK_THROWS_WITH_AS(l1_loss(i64({1}), i64({1})), doctest::Contains("[l1_loss] needs floating"),
                       std::invalid_argument);
}

TEST_CASE("one_hot values, inference and errors") {
  const Tensor oh = one_hot(i64({0, 2, 1}), 4);
  CHECK(oh.dtype() == DType::i64);
  CHECK(oh.shape() == Shape{3, 4});
  CHECK(vals(oh) == Values{1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0});
  CHECK(one_hot(i64({0, 2, 1})).shape() == Shape{3, 3});
  CHECK(one_hot(i64({1, 0}, {2, 1}), -1).shape() == Shape{2, 1, 2});
  CHECK(one_hot(zeros({0}, {.dtype = DType::i64}), 4).shape() == Shape{0, 4});
  CHECK_THROWS_WITH_AS(one_hot(i64({0, 4}), 4),
                       doctest::Contains("[one_hot] index 4 is out of range for 4 classes"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(one_hot(i64({-1}), 3), doctest::Contains("index -1"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(one_hot(zeros({0}, {.dtype = DType::i64})),
                       doctest::Contains("cannot infer num_classes"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(one_hot(t64({1})), doctest::Contains("[one_hot] indices must be integers"),
                       std::invalid_argument);
}

TEST_CASE("layer_norm and group_norm values and errors") {
  const Tensor x = t64({1, 2, 3, 4, 2, 2, 2, 2}, {2, 4});
  const Values y = vals(layer_norm(x, {4}, {}, {}, 0.0));
  const double s = std::sqrt(1.25);
  CHECK(y[0] == doctest::Approx(-1.5 / s));
  CHECK(y[3] == doctest::Approx(1.5 / s));
  // A constant row normalises to 0; eps keeps it finite.
  CHECK(vals(layer_norm(x, {4}))[5] == 0.0);
  const Values z = vals(layer_norm(x, {4}, t64({1, 1, 1, 2}), t64({0, 0, 0, 1})));
  CHECK(z[3] == doctest::Approx(2 * 1.5 / std::sqrt(1.25 + 1e-5) + 1));
  // group_norm with one group per channel of a [N, C, L] input.
  const Values g = vals(group_norm(x.reshape({1, 2, 4}), 2, {}, {}, 0.0));
  CHECK(g[0] == doctest::Approx(-1.5 / s));
  CHECK(vals(group_norm(x.reshape({1, 2, 4}), 2))[4] == 0.0);
  CHECK_THROWS_WITH_AS(layer_norm(x, {3}), doctest::Contains("[layer_norm] normalized_shape [3]"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(layer_norm(x, {}), doctest::Contains("[layer_norm]"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(layer_norm(x, {4}, ones({3})), doctest::Contains("weight shape [3]"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(group_norm(x.reshape({1, 2, 4}), 3),
                       doctest::Contains("[group_norm] num_groups 3"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(group_norm(t64({1, 2}), 1), doctest::Contains("[N, C, *]"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(group_norm(x.reshape({1, 2, 4}), 2, {}, ones({4})),
                       doctest::Contains("bias shape [4]"), std::invalid_argument);
}

TEST_CASE("group_norm reads channels-last memory where it lies, on every device") {
  // [N, H, W, C] memory seen as [N, C, H, W]: what a channels-last
  // convolution hands on. The output keeps that layout, and values and
  // gradients equal those of the same input stored channels first.
  Generator gen(17);
  const Tensor mem = randn({2, 5, 3, 6}, gen, {.dtype = DType::f64});
  const Tensor w0 = randn({6}, gen, {.dtype = DType::f64});
  const Tensor b0 = randn({6}, gen, {.dtype = DType::f64});
  const Tensor r0 = randn({2, 6, 5, 3}, gen, {.dtype = DType::f64});
  const auto loss = [&](const Tensor& x, const Tensor& w, const Tensor& b) {
    return sum(mul(group_norm(x, 3, w, b), r0.to(x.device()).to(x.dtype())));
  };
  // The f64 finite-difference check of the channels-last path itself.
  const Tensor numeric = numeric_grad(
      [&](const Tensor& m) {
        return loss(permute(m, {0, 3, 1, 2}), w0, b0).item<double>();
      },
      mem);
  for (const Device dev : cpu_and_test_devices()) {
    for (const DType dt : {DType::f64, DType::f32}) {
      INFO(dev.str() << " " << std::string(dtype_name(dt)));
      const double tol = dt == DType::f64 ? 1e-12 : 1e-5;
      const Tensor last = mem.to(dt).to(dev).detach().requires_grad_(true);
      const Tensor first = permute(last, {0, 3, 1, 2}).contiguous().detach().requires_grad_(true);
      const Tensor w1 = w0.to(dt).to(dev).detach().requires_grad_(true),
                   w2 = w1.detach().requires_grad_(true);
      const Tensor b1 = b0.to(dt).to(dev).detach().requires_grad_(true),
                   b2 = b1.detach().requires_grad_(true);
      const Tensor y = group_norm(permute(last, {0, 3, 1, 2}), 3, w1, b1);
      CHECK(permute(y, {0, 2, 3, 1}).is_contiguous());
      CHECK(max_rel_diff(y, group_norm(first, 3, w2, b2)) < tol);
      loss(permute(last, {0, 3, 1, 2}), w1, b1).backward();
      loss(first, w2, b2).backward();
      CHECK(max_rel_diff(permute(last.grad(), {0, 3, 1, 2}), first.grad()) < tol);
      CHECK(max_rel_diff(w1.grad(), w2.grad()) < tol);
      CHECK(max_rel_diff(b1.grad(), b2.grad()) < tol);
      if (dt == DType::f64) CHECK(max_rel_diff(last.grad(), numeric) < 1e-6);
    }
  }
}

TEST_CASE("layer_norm: gradients onto an input's other uses, 16-bit inputs, frozen affines") {
  Generator gen(23);
  const Tensor x0 = randn({4, 7}, gen, {.dtype = DType::f64});
  const Tensor r1 = randn({4, 7}, gen, {.dtype = DType::f64});
  const Tensor w = randn({7}, gen, {.dtype = DType::f64});
  // h = 1.5 x on a residual stream, read by the norm and the residual add:
  // its gradient is the sum of both, the norm's added onto the add's in the
  // kernel (with an op between the norm and the add, as attention is, the
  // add's gradient for h is the engine's alone when the norm runs).
  const auto f = [&](const Tensor& x) {
    const Device d = x.device();
    const Tensor h = x * 1.5;
    const Tensor y = layer_norm(h, {7}, w.to(d)) * 3.0;
    return sum(mul(add(y, h), r1.to(d)));
  };
  const Tensor numeric = numeric_grad([&](const Tensor& x) { return f(x).item<double>(); }, x0);
  for (const Device dev : cpu_and_test_devices()) {
    INFO(dev.str());
    const Tensor x = x0.to(dev).detach().requires_grad_(true);
    f(x).backward();
    CHECK(max_rel_diff(x.grad(), numeric) < 1e-6);
    // A frozen weight gets no gradient, the input still does.
    const Tensor frozen = w.to(dev);
    const Tensor x2 = x0.to(dev).detach().requires_grad_(true);
    sum(layer_norm(x2, {7}, frozen)).backward();
    CHECK(!frozen.grad().defined());
    CHECK(x2.grad().defined());
    // bf16 and f16 inputs compute in f32: the output and the gradient keep
    // the input's dtype and lie within its rounding of the f32 result.
    const Tensor want = layer_norm(x0.to(DType::f32).to(dev), {7}, w.to(DType::f32).to(dev));
    for (const DType half : {DType::bf16, DType::f16}) {
      INFO(std::string(dtype_name(half)));
      const Tensor xh = x0.to(half).to(dev).detach().requires_grad_(true);
      const Tensor y = layer_norm(xh, {7}, w.to(half).to(dev));
      CHECK(y.dtype() == half);
      CHECK(max_rel_diff(y.to(DType::f32), want) < 4 * half_tol(half));
      sum(y).backward();
      CHECK(xh.grad().dtype() == half);
    }
  }
}

TEST_CASE("layer_norm and group_norm refuse a bad eps and integer parameters by name") {
  const Tensor x = t64({1, 2, 3, 4}, {1, 4});
  CHECK_THROWS_WITH_AS(layer_norm(x, {4}, {}, {}, -1.0),
                       doctest::Contains("[layer_norm] eps must be finite and >= 0"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(group_norm(x.reshape({1, 2, 2}), 2, {}, {}, NAN),
                       doctest::Contains("[group_norm] eps must be finite"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(layer_norm(x, {4}, ones({4}, {.dtype = DType::i64})),
                       doctest::Contains("[layer_norm] needs floating weight"),
                       std::invalid_argument);
}
