// Gradient routes of the VQ layers: rotation trick against its closed form
// and a finite-difference check in f64, the straight-through identity, and
// the fused commitment loss.
#include <doctest/doctest.h>

#include <cmath>

#include "quant/vq/commitment_loss.h"
#include "quant/vq/directional_reparam.h"
#include "quant/vq/nearest_code.h"
#include "quant/vq/rotation_trick.h"
#include "quant/vq/vector_quantize.h"
#include "quanta.h"
#include "vq_test_util.h"

using namespace quanta;
using namespace quanta::quant;
using quanta::testing::max_abs_diff;
using quanta::testing::numeric_grad;

namespace {

// lambda R^T g for one row, with R built as an explicit matrix in f64.
std::vector<double> closed_form(const std::vector<double>& x, const std::vector<double>& q,
                                const std::vector<double>& g) {
  const size_t d = x.size();
  double xn = 0, qn = 0;
  for (size_t i = 0; i < d; ++i) xn += x[i] * x[i], qn += q[i] * q[i];
  xn = std::sqrt(xn), qn = std::sqrt(qn);
  std::vector<double> u(d), qh(d), w(d);
  double wn = 0;
  for (size_t i = 0; i < d; ++i)
    u[i] = x[i] / xn, qh[i] = q[i] / qn, wn += std::pow(u[i] + qh[i], 2);
  wn = std::sqrt(wn);
  for (size_t i = 0; i < d; ++i) w[i] = (u[i] + qh[i]) / wn;
  std::vector<double> out(d, 0.0);
  for (size_t i = 0; i < d; ++i)
    for (size_t j = 0; j < d; ++j) {
      const double r_ji = (i == j ? 1.0 : 0.0) - 2 * w[j] * w[i] + 2 * qh[j] * u[i];  // R[j][i]
      out[i] += qn / xn * r_ji * g[j];
    }
  return out;
}

}  // namespace

TEST_CASE("rotation trick: value is the code, gradient is lambda R^T g") {
  Generator gen(7);
  const Tensor x0 = randn({5, 6}, gen, {.dtype = DType::f64});
  const Tensor q = randn({5, 6}, gen, {.dtype = DType::f64});
  const Tensor g = randn({5, 6}, gen, {.dtype = DType::f64});
  Tensor x = x0.clone();
  x.requires_grad_(true);
  const Tensor y = rotate_to(x, q);
  CHECK(max_abs_diff(y, q) == 0.0);
  sum(y * g).backward();
  for (int64_t r = 0; r < 5; ++r) {
    const auto expect =
        closed_form(select(x0, 0, r).to_vector<double>(), select(q, 0, r).to_vector<double>(),
                    select(g, 0, r).to_vector<double>());
    CHECK(max_abs_diff(select(x.grad(), 0, r), from_vector<double>(expect)) < 1e-12);
  }
  // Finite differences of the rotation with its constants frozen at x0:
  // f(x) = lambda (x - 2 (x.w) w + 2 (x.u) q^) is what the gradient belongs to.
  const auto xv = x0.to_vector<double>();
  auto frozen = [&](const Tensor& xt) {
    const auto v = xt.to_vector<double>();
    double total = 0;
    for (int64_t r = 0; r < 5; ++r) {
      std::vector<double> row(xv.begin() + r * 6, xv.begin() + (r + 1) * 6);
      std::vector<double> grow(6);
      for (int e = 0; e < 6; ++e) {  // the closed form is linear: J^T e_k columns
        std::vector<double> basis(6, 0.0);
        basis[e] = 1.0;
        grow[e] = 0;
        const auto col = closed_form(row, select(q, 0, r).to_vector<double>(), basis);
        for (int i = 0; i < 6; ++i) grow[e] += col[i] * v[r * 6 + i];
      }
      const auto gr = select(g, 0, r).to_vector<double>();
      for (int e = 0; e < 6; ++e) total += grow[e] * gr[e];
    }
    return total;
  };
  CHECK(max_abs_diff(numeric_grad(frozen, x0), x.grad()) < 1e-7);
}

TEST_CASE("rotation trick: x parallel to q scales the gradient by |q|/|x|") {
  const Tensor x0 = from_vector<double>({1, 2, 2}, {1, 3});  // |x| = 3
  const Tensor q = x0 * 2.0;                                 // |q| = 6
  Tensor x = x0.clone();
  x.requires_grad_(true);
  const Tensor g = from_vector<double>({0.5, -1, 3}, {1, 3});
  sum(rotate_to(x, q) * g).backward();
  CHECK(max_abs_diff(x.grad(), g * 2.0) < 1e-12);
}

TEST_CASE("commitment loss: value, f64 gradient check, mask") {
  Generator gen(3);
  const Tensor x0 = randn({4, 3, 5}, gen, {.dtype = DType::f64});
  const Tensor q = randn({4, 3, 5}, gen, {.dtype = DType::f64});
  const Tensor valid = from_vector<uint8_t>({1, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0}, {4, 3});
  const Tensor vb = to_dtype(valid, DType::boolean);
  Tensor x = x0.clone();
  x.requires_grad_(true);
  const Tensor l = commitment_loss(x, q, vb);
  // Reference with plain ops.
  const Tensor err = square(q - x0) * unsqueeze(to_dtype(valid, DType::f64), -1);
  CHECK(l.item() == doctest::Approx((sum(err) / (8.0 * 5.0)).item()).epsilon(1e-12));
  l.backward();
  auto f = [&](const Tensor& xt) { return commitment_loss(xt, q, vb).item(); };
  CHECK(max_abs_diff(numeric_grad(f, x0), x.grad()) < 1e-7);
  // Nothing valid: zero, not NaN.
  const Tensor none = zeros({4, 3}, {.dtype = DType::boolean});
  CHECK(commitment_loss(x0, q, none).item() == 0.0);
}

TEST_CASE("straight-through: the input gradient is the identity") {
  Generator gen(11);
  VectorQuantizeOptions o;
  o.dim = 6;
  o.codebook_size = 10;
  o.rotation_trick = false;
  o.commitment_weight = 0;
  VectorQuantize vq(o, gen);
  Tensor x = randn({2, 5, 6}, gen);
  x.requires_grad_(true);
  const Tensor w = randn({2, 5, 6}, gen);
  QuantizeOutput out = vq.forward(x);
  sum(out.quantized * w).backward();
  CHECK(max_abs_diff(x.grad(), w) == 0.0);
}

TEST_CASE("nearest_codes agrees with brute force (euclidean and cosine)") {
  Generator gen(5);
  const Tensor x = randn({300, 7}, gen);
  const Tensor c = randn({37, 7}, gen);
  for (bool cosine : {false, true}) {
    const Tensor xs = cosine ? l2norm(x) : x, cs = cosine ? l2norm(c) : c;
    const auto idx = nearest_codes(xs, cs, cosine).to_vector<int64_t>();
    const auto xv = xs.to_vector<double>(), cv = cs.to_vector<double>();
    for (int64_t i = 0; i < 300; ++i) {
      int64_t best = 0;
      double best_s = 1e300;
      for (int64_t k = 0; k < 37; ++k) {
        double s = 0;
        for (int e = 0; e < 7; ++e) {
          const double a = xv[i * 7 + e], b = cv[k * 7 + e];
          s += cosine ? -a * b : (a - b) * (a - b);
        }
        if (s < best_s) best_s = s, best = k;
      }
      CHECK(idx[i] == best);
    }
  }
  CHECK(nearest_codes(zeros({0, 7}), c, false).numel() == 0);
}

TEST_CASE("nearest_codes: first code on ties, in every lane and the tail; NaN never wins") {
  // 70 codes (past a 16- and 8-lane block, with a tail), every one a copy of
  // the same few rows: the first copy of the nearest row must win.
  for (const DType dt : {DType::f32, DType::f64}) {
    const int64_t k = 70;
    std::vector<double> cv;
    for (int64_t j = 0; j < k; ++j)
      for (int e = 0; e < 3; ++e) cv.push_back(double((j * 7) % 5) + e);  // rows repeat every 5
    const Tensor c = to_dtype(from_vector<double>(cv, {k, 3}), dt);
    for (int64_t target = 0; target < 5; ++target) {
      const Tensor x = to_dtype(slice(c, 0, target, target + 1), dt);
      CHECK(nearest_codes(x, c, false).item<int64_t>() == target);
    }
    // A code whose score is NaN is never chosen.
    std::vector<double> nan_cv = cv;
    nan_cv[0] = std::nan("");
    const Tensor cn = to_dtype(from_vector<double>(nan_cv, {k, 3}), dt);
    CHECK(nearest_codes(to_dtype(slice(c, 0, 0, 1), dt), cn, false).item<int64_t>() == 5);
  }
}

TEST_CASE("route_with_commitment equals the separate ops, value and gradient (f64)") {
  Generator gen(19);
  const Tensor x0 = randn({4, 3, 5}, gen, {.dtype = DType::f64});
  const Tensor q = randn({4, 3, 5}, gen, {.dtype = DType::f64});
  const Tensor g = randn({4, 3, 5}, gen, {.dtype = DType::f64});
  const Tensor vb =
      to_dtype(from_vector<uint8_t>({1, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0}, {4, 3}), DType::boolean);
  const double weight = 0.7;
  for (const GradientRoute route : {GradientRoute::rotation, GradientRoute::straight_through})
    for (const Tensor& valid : {Tensor(), vb}) {
      CAPTURE(int(route));
      CAPTURE(valid.defined());
      auto separate = [&](const Tensor& xt) {
        const Tensor y =
            route == GradientRoute::rotation ? rotate_to(xt, q) : straight_through(xt, q);
        return sum(y * g) + commitment_loss(xt, q, valid) * weight;
      };
      auto fused = [&](const Tensor& xt) {
        const TrainingOutput t = route_with_commitment(xt, q, valid, route);
        CHECK(max_abs_diff(t.quantized, q) == 0.0);  // the value is the code itself
        return sum(t.quantized * g) + t.commitment * weight;
      };
      Tensor xa = x0.clone(), xb = x0.clone();
      xa.requires_grad_(true);
      xb.requires_grad_(true);
      const Tensor la = separate(xa), lb = fused(xb);
      CHECK(lb.item() == doctest::Approx(la.item()).epsilon(1e-12));
      la.backward();
      lb.backward();
      CHECK(max_abs_diff(xb.grad(), xa.grad()) < 1e-12);
      // The commitment part against finite differences (the route's own
      // gradient is checked against its closed form above).
      Tensor xc = x0.clone();
      xc.requires_grad_(true);
      route_with_commitment(xc, q, valid, route).commitment.backward();
      auto commit = [&](const Tensor& xt) {
        return route_with_commitment(xt, q, valid, route).commitment.item();
      };
      CHECK(max_abs_diff(numeric_grad(commit, x0), xc.grad()) < 1e-7);
    }
  // Nothing valid: a zero commitment and the route's gradient alone.
  Tensor x = x0.clone();
  x.requires_grad_(true);
  const TrainingOutput t = route_with_commitment(x, q, zeros({4, 3}, {.dtype = DType::boolean}),
                                                 GradientRoute::straight_through);
  CHECK(t.commitment.item() == 0.0);
  (sum(t.quantized * g) + t.commitment).backward();
  CHECK(max_abs_diff(x.grad(), g) == 0.0);
  CHECK_THROWS_WITH_AS(
      route_with_commitment(x, slice(q, 2, 0, 4), Tensor(), GradientRoute::rotation),
      doctest::Contains("route_with_commitment"), std::invalid_argument);
}

TEST_CASE("directional_reparam: value x + n |q - x|, f64 gradient with the direction frozen") {
  Generator gen(31);
  const Tensor x0 = randn({4, 5}, gen, {.dtype = DType::f64});
  const Tensor q0 = randn({4, 5}, gen, {.dtype = DType::f64});
  const Tensor noise = randn({4, 5}, gen, {.dtype = DType::f64});
  const Tensor g = randn({4, 5}, gen, {.dtype = DType::f64});
  const double var = 0.3;
  // The direction n at the base point, as a constant.
  const Tensor n = l2norm(q0 - x0 + noise * std::sqrt(var));
  Tensor x = x0.clone(), q = q0.clone();
  x.requires_grad_(true);
  q.requires_grad_(true);
  const Tensor y = directional_reparam(x, q, var, noise);
  CHECK(max_abs_diff(y, x0 + n * norm(q0 - x0, 2.0, {-1}, true)) < 1e-14);
  sum(y * g).backward();
  auto in_x = [&](const Tensor& xt) {
    return sum((xt + n * norm(q0 - xt, 2.0, {-1}, true)) * g).item();
  };
  auto in_q = [&](const Tensor& qt) {
    return sum((x0 + n * norm(qt - x0, 2.0, {-1}, true)) * g).item();
  };
  CHECK(max_abs_diff(numeric_grad(in_x, x0), x.grad()) < 1e-7);
  CHECK(max_abs_diff(numeric_grad(in_q, q0), q.grad()) < 1e-7);
  // Without noise the value is the code, up to rounding.
  CHECK(max_abs_diff(directional_reparam(x0, q0, var, Tensor()), q0) < 1e-12);
  CHECK(max_abs_diff(directional_reparam(x0, q0, 0.0, noise), q0) < 1e-12);
  // A zero error has a zero gradient, not NaN.
  Tensor same = x0.clone();
  same.requires_grad_(true);
  sum(directional_reparam(same, x0, var, noise)).backward();
  CHECK(max_abs_diff(same.grad(), ones({4, 5}, {.dtype = DType::f64})) == 0.0);
  CHECK_THROWS_WITH_AS(directional_reparam(x0, q0, -1.0, noise),
                       doctest::Contains("variance must be >= 0"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(directional_reparam(x0, q0, var, zeros({4, 4}, {.dtype = DType::f64})),
                       doctest::Contains("noise must have x's shape"), std::invalid_argument);
}
