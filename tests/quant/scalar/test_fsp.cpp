// FSP (finite scalar perturbation): bins and codes against their definition,
// an f64 finite-difference check of every CDF activation and of the
// statistics loss, where the draws come from, the refusals, and a device run
// without host reads. quanta parity checks the numbers against
// vector-quantize-pytorch 1.32 (fsp_* reference vectors).
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "quant/scalar/fsp.h"
#include "quanta.h"
#include "support/gpu.h"
#include "support/numeric_grad.h"

using namespace quanta;
using namespace quanta::quant;
using quanta::testing::numeric_grad;

namespace {

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const auto x = a.detach().to(Device::cpu()).to_vector<double>();
  const auto y = b.detach().to(Device::cpu()).to_vector<double>();
  double m = x.size() == y.size() ? 0.0 : 1e300;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

double cdf(const std::string& act, double z) {
  if (act == "tanh") return (std::tanh(z) + 1) / 2;
  if (act == "sigmoid") return 1 / (1 + std::exp(-z));
  if (act == "normal") return (1 + std::erf(z / std::sqrt(2.0))) / 2;
  if (act == "laplace")
    return 0.5 * (1 + (z > 0 ? 1 : z < 0 ? -1 : 0) * (1 - std::exp(-std::abs(z))));
  return std::atan(z) / M_PI + 0.5;
}

}  // namespace

TEST_CASE("FSP in eval: each element the midpoint of its CDF bin, indices mixed-radix") {
  for (const std::string act : {"tanh", "sigmoid", "normal", "laplace", "cauchy"}) {
    for (bool inverse : {false, true}) {
      CAPTURE(act);
      CAPTURE(inverse);
      Generator gen(1), data(2);
      FSPOptions o;
      o.levels = {8, 5, 3};
      o.act_name = act;
      o.need_inv_act = inverse;
      FSP fsp(o, gen);
      fsp.eval();
      const Tensor x = randn({2, 7, 3}, data, {.dtype = DType::f64}) * 1.5;
      const QuantizeOutput out = fsp.forward(x, Tensor());
      const auto xv = x.to_vector<double>(), q = out.quantized.to_vector<double>();
      const auto idx = out.indices.to_vector<int64_t>();
      for (size_t t = 0; t < 14; ++t) {
        int64_t index = 0, basis = 1;
        for (size_t i = 0; i < 3; ++i) {
          const int64_t levels = o.levels[i];
          const double p = cdf(act, xv[t * 3 + i]);
          const int64_t bin =
              std::min<int64_t>(int64_t(std::floor(p * double(levels))), levels - 1);
          const double mid = (double(bin) + 0.5) / double(levels);
          double want = (mid - 0.5) * std::sqrt(12.0);
          if (inverse) {  // the z whose CDF is the midpoint
            double lo = -60, hi = 60;
            for (int k = 0; k < 200; ++k)
              (cdf(act, 0.5 * (lo + hi)) < mid ? lo : hi) = 0.5 * (lo + hi);
            want = 0.5 * (lo + hi);
          }
          CHECK(q[t * 3 + i] == doctest::Approx(want).epsilon(1e-9));
          index += bin * basis;
          basis *= levels;
        }
        CHECK(idx[t] == index);
      }
      CHECK(max_abs_diff(fsp.get_output_from_indices(out.indices), out.quantized) < 1e-9);
    }
  }
}

TEST_CASE("FSP: f64 gradient check of every activation and of the statistics loss") {
  for (const std::string act : {"tanh", "sigmoid", "normal", "laplace", "cauchy"}) {
    CAPTURE(act);
    Generator gen(3), data(4);
    FSPOptions o;
    o.levels = {8, 5};
    o.dim = 3;  // projections: the loss's gradient reaches them
    o.act_name = act;
    o.vector_norm = "kurt";
    FSP fsp(o, gen);
    fsp.to(DType::f64);
    fsp.train();
    // Perturbation offset 0 on every element: the output is the activation
    // itself rescaled, (CDF(z) - 1/2) sqrt(12), which is smooth.
    fsp.uniform_draws = [](const std::string& what, const Shape& s, const TensorOptions& t) {
      return full(s, what == "perturbation" ? 0.5 : 1.0, t);
    };
    const Tensor x0 = randn({2, 5, 3}, data, {.dtype = DType::f64});
    const Tensor w = randn({2, 5, 3}, data, {.dtype = DType::f64});
    auto f = [&](const Tensor& xt) {
      const QuantizeOutput out = fsp.forward(xt, Tensor());
      return (sum(out.quantized * w) + out.loss).item();
    };
    Tensor x = x0.clone();
    x.requires_grad_(true);
    const QuantizeOutput out = fsp.forward(x, Tensor());
    (sum(out.quantized * w) + out.loss).backward();
    CHECK(max_abs_diff(numeric_grad(f, x0), x.grad()) < 1e-6);
    CHECK(out.term("p_accept_prob").item() == 1.0);
  }
}

TEST_CASE("FSP: the perturbation draws come from the step stream; eval draws nothing") {
  Generator g1(5), g2(5), data(6);
  FSPOptions o;
  o.levels = {8, 5, 5, 5};
  FSP a(o, g1), b(o, g2);
  const Tensor x = randn({2, 6, 4}, data);
  const Tensor first = a.forward(x);
  CHECK(max_abs_diff(first, b.forward(x)) == 0.0);  // the same seed, the same draws
  CHECK(max_abs_diff(first, a.forward(x)) > 0.0);   // the next forward, new draws
  a.pin_random_step(3);
  CHECK(max_abs_diff(a.forward(x), a.forward(x)) == 0.0);
  a.eval();
  const QuantizeOutput e = a.forward(x, Tensor());
  CHECK(max_abs_diff(e.quantized, a.get_output_from_indices(e.indices)) <
        1e-6);  // straight-through rounding
  CHECK(e.term("p_accept_prob").item() == 0.0);
}

TEST_CASE("FSP: refusals name the option") {
  Generator gen(7);
  FSPOptions o;
  o.levels = {8, 1};
  CHECK_THROWS_WITH_AS(FSP(o, gen), doctest::Contains("every level must be >= 2"),
                       std::invalid_argument);
  o.levels = {8, 5};
  o.act_name = "relu";
  CHECK_THROWS_WITH_AS(FSP(o, gen), doctest::Contains("act_name must be one of"),
                       std::invalid_argument);
  o.act_name = "tanh";
  o.vector_norm = "l2";
  CHECK_THROWS_WITH_AS(FSP(o, gen), doctest::Contains("vector_norm must be one of"),
                       std::invalid_argument);
  o.vector_norm = "none";
  o.quantize_rate = 1.5;
  CHECK_THROWS_WITH_AS(FSP(o, gen), doctest::Contains("quantize_rate must lie in [0, 1]"),
                       std::invalid_argument);
  o.quantize_rate = 0;
  FSP ok(o, gen);
  CHECK_THROWS_WITH_AS(ok.get_output_from_indices(from_vector<int32_t>({40}, {1})),
                       doctest::Contains("index 40 outside [0, 40)"), std::invalid_argument);
}

TEST_CASE("FSP on a device: a training step reads nothing back, the CPU's numbers on sim") {
  FSPOptions o;
  o.levels = {8, 6, 5};
  o.dim = 6;
  o.act_name = "normal";
  o.need_inv_act = true;
  o.quantize_rate = 0.5;
  Generator data(8);
  const Tensor x = randn({2, 5, 6}, data);
  Generator g0(9);
  FSP cpu(o, g0);
  Tensor xc = x.clone();
  xc.requires_grad_(true);
  const QuantizeOutput ref = cpu.forward(xc, Tensor());
  (sum(ref.quantized) + ref.loss).backward();
  for (const Device device : testing::test_devices()) {
    CAPTURE(device.str());
    Generator g(9);
    FSP fsp(o, g);
    fsp.to(device);
    Tensor xd = x.to(device);
    xd.requires_grad_(true);
    QuantizeOutput out;
    {
      HostSyncGuard guard("an FSP training step");
      out = fsp.forward(xd, Tensor());
      (sum(out.quantized) + out.loss).backward();
    }
    if (!device.is_sim()) continue;  // a GPU rounds transcendental functions differently
    CHECK(max_abs_diff(out.quantized, ref.quantized) == 0.0);
    CHECK(max_abs_diff(xd.grad(), xc.grad()) == 0.0);
  }
}
