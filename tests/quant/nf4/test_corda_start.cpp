// CorDA's start (corda_start.h): with the damped covariance C', scaling B A
// C' is the chosen singular triplets' part of W C' (the largest for ipm, the
// smallest for kpm), the residual is the rest of W, an isotropic covariance
// gives PiSSA's start, and bad covariances are refused naming the layer.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "quant/nf4/corda_start.h"
#include "quanta.h"
#include "support/relative_error.h"

using namespace quanta;
using namespace quanta::quant;
using quanta::testing::max_abs;
using quanta::testing::max_rel_diff;

namespace {

// C + 0.01 mean(diag C) I: PEFT's first damping, enough for a covariance
// of many more samples than features.
Tensor damped(const Tensor& c) {
  const int64_t n = c.size(0);
  const Tensor identity = eye(n, -1, {.dtype = c.dtype()});
  const double mean = sum(c * identity).item() / double(n);
  return c + identity * (0.01 * mean);
}

// The part of m's singular triplets [first, first + count) adds up to.
Tensor triplets_part(const Tensor& m, int64_t first, int64_t count) {
  const int64_t most = std::min(m.size(0), m.size(1));
  const SingularTriplets t = top_singular_triplets(m, most);
  const Tensor u = narrow(t.u, 1, first, count), vh = narrow(t.vh, 0, first, count);
  return matmul(u * unsqueeze(narrow(t.s, 0, first, count), 0), vh);
}

}  // namespace

TEST_CASE("CorDA's start: scaling B A C' is the chosen triplets of W C', the residual the rest") {
  Generator gen(41);
  const Tensor w = randn({16, 24}, gen, {.dtype = DType::f64}) * 0.1;
  // Inputs whose features differ in scale, as a layer's do.
  const Tensor x = randn({200, 24}, gen, {.dtype = DType::f64}) *
                   unsqueeze(arange(1.0, 25.0, 1.0, {.dtype = DType::f64}) * 0.2, 0);
  const Tensor c = matmul(transpose(x, 0, 1), x) / 200.0;
  const double scaling = 2.0;
  for (const CordaMethod method : {CordaMethod::ipm, CordaMethod::kpm}) {
    INFO(corda_method_name(method));
    const ResidualStart s = corda_starts({{w, 3, scaling, DType::f64}}, {c}, method)[0];
    CHECK(s.lora_A.shape() == Shape{3, 24});
    CHECK(s.lora_B.shape() == Shape{16, 3});
    const Tensor taken = matmul(s.lora_B, s.lora_A) * scaling;
    const Tensor wc = matmul(w, damped(c));
    const Tensor want =
        method == CordaMethod::ipm ? triplets_part(wc, 0, 3) : triplets_part(wc, 16 - 3, 3);
    CHECK(max_rel_diff(matmul(taken, damped(c)), want) < 1e-9);
    CHECK(max_rel_diff(s.residual + taken, w) < 1e-12);
    // The factors share each singular value evenly: B's columns have norms
    // sqrt(s / scaling), as A V's rows do.
    const Tensor b_norms = sqrt(sum(square(s.lora_B), {0}));
    const SingularTriplets t = top_singular_triplets(wc, 16);
    const Tensor chosen = narrow(t.s, 0, method == CordaMethod::ipm ? 0 : 13, 3);
    CHECK(max_rel_diff(b_norms, sqrt(chosen / scaling)) < 1e-9);
  }
  // ipm takes the directions that carry the inputs: W C' loses far less
  // than with kpm's.
  const ResidualStart ipm = corda_starts({{w, 3, scaling, DType::f64}}, {c}, CordaMethod::ipm)[0];
  const ResidualStart kpm = corda_starts({{w, 3, scaling, DType::f64}}, {c}, CordaMethod::kpm)[0];
  const double kept_ipm = sum(square(matmul(x, transpose(ipm.residual, 0, 1)))).item();
  const double kept_kpm = sum(square(matmul(x, transpose(kpm.residual, 0, 1)))).item();
  CHECK(kept_ipm < 0.9 * kept_kpm);
}

TEST_CASE("CorDA's start over an isotropic covariance takes PiSSA's part out") {
  Generator gen(5);
  const Tensor w = randn({12, 20}, gen) * 0.1;
  const Tensor c = eye(20) * 3.0;
  const ResidualStart corda = corda_starts({{w, 4, 2.0}}, {c}, CordaMethod::ipm)[0];
  const ResidualStart pissa = pissa_starts({{w, 4, 2.0}})[0];
  CHECK(corda.lora_A.dtype() == DType::f32);
  CHECK(max_rel_diff(matmul(corda.lora_B, corda.lora_A), matmul(pissa.lora_B, pissa.lora_A)) <
        1e-5);
  CHECK(max_rel_diff(corda.residual, pissa.residual) < 1e-5);
  // The factors split it unevenly: W C' = 3.03 W puts sqrt(3.03) on B and
  // V = Vh^T / 3.03 leaves A 1 / sqrt(3.03) of PiSSA's.
  const double k = std::sqrt(3.0 * 1.01);
  CHECK(max_rel_diff(corda.lora_B, pissa.lora_B * k) < 1e-5);
  CHECK(max_rel_diff(corda.lora_A, pissa.lora_A / k) < 1e-5);
}

TEST_CASE("CorDA's start refuses covariances it cannot use, naming the layer") {
  Generator gen(2);
  const Tensor w = randn({8, 6}, gen);
  const Tensor good = eye(6);
  CHECK_THROWS_WITH_AS(corda_starts({{w, 2, 1.0}, {w, 2, 1.0}}, {good, eye(5)}, CordaMethod::ipm),
                       doctest::Contains("layer 1: the input covariance must be [6, 6]"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(corda_starts({{w, 2, 1.0}}, {zeros({6, 6})}, CordaMethod::ipm),
                       doctest::Contains("inputs were all zero"), std::invalid_argument);
  std::vector<float> values(36, 0.0f);
  for (int i = 0; i < 6; ++i) values[std::size_t(i * 7)] = 1.0f;
  values[7] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH_AS(
      corda_starts({{w, 2, 1.0}}, {from_vector<float>(values, {6, 6})}, CordaMethod::ipm),
      doctest::Contains("entry (1, 1) of the input covariance is not finite"),
      std::invalid_argument);
  CHECK_THROWS_WITH_AS(corda_starts({{w, 7, 1.0}}, {good}, CordaMethod::kpm),
                       doctest::Contains("rank 7 is outside [1, 6]"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(corda_starts({{w, 2, 1.0}}, {}, CordaMethod::ipm),
                       doctest::Contains("1 layers and 0 covariances"), std::invalid_argument);
  CHECK(parse_corda_method("kpm") == CordaMethod::kpm);
  CHECK_THROWS_WITH_AS(parse_corda_method("pca"), doctest::Contains("ipm"), std::invalid_argument);
}
