// gated_activation (SwiGLU, GeGLU): op-harness rows (f64 finite
// differences, zero-size, 16-bit, every device), the two ops it replaces
// within rounding, bf16's roundings, the memory it holds, errors.
#include <doctest/doctest.h>

#include <cmath>

#include "engine/cpu/block_cache.h"
#include "engine/ops/harness.h"
#include "llm/ops/gated_act.h"
#include "support/gpu.h"

using namespace quanta;
using namespace quanta::testing;

TEST_CASE("swiglu: op harness") {
  OpCase c;
  c.name = "swiglu";
  c.shapes = {{3, 4, 8}, {3, 4, 8}};
  c.zero_shapes = {{0, 8}, {0, 8}};
  c.op = [](const Inputs& xs) { return llm::swiglu(xs[0], xs[1]); };
  c.reference = [](const Inputs& xs) {
    return ref_elementwise(
        xs, [](const std::vector<double>& v) { return v[0] / (1 + std::exp(-v[0])) * v[1]; });
  };
  c.half = true;
  run_case(c);
}

namespace {

// The largest |a - b| over |b|'s largest value.
double rel_diff(const Tensor& a, const Tensor& b) {
  return max(abs(a.to(DType::f64) - b.to(DType::f64))).item() / max(abs(b.to(DType::f64))).item();
}

// GELU's tanh approximation in f64.
double gelu_tanh(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}

}  // namespace

TEST_CASE("gated_activation gelu_tanh: op harness") {
  OpCase c;
  c.name = "geglu";
  c.shapes = {{3, 4, 8}, {3, 4, 8}};
  c.zero_shapes = {{0, 8}, {0, 8}};
  c.op = [](const Inputs& xs) {
    return llm::gated_activation(xs[0], xs[1], llm::GatedAct::gelu_tanh);
  };
  c.reference = [](const Inputs& xs) {
    return ref_elementwise(xs, [](const std::vector<double>& v) { return gelu_tanh(v[0]) * v[1]; });
  };
  c.half = true;
  run_case(c);
}

TEST_CASE("gated_activation gelu_tanh: mul(gelu(gate, tanh), up)'s values and gradients") {
  for (const Device dev : test_devices()) {
    INFO(dev.str());
    Generator gen(6);
    // 6001 values: pieces of 1024 and a ragged last one; gates far out too,
    // where tanh saturates.
    const Tensor g0 = randn({353, 17}, gen) * 4.0, u0 = randn({353, 17}, gen),
                 probe = randn({353, 17}, gen);
    Tensor g1 = g0.to(dev).requires_grad_(), u1 = u0.to(dev).requires_grad_();
    Tensor g2 = g0.clone().requires_grad_(), u2 = u0.clone().requires_grad_();
    Tensor g3 = g0.to(DType::f64).requires_grad_(), u3 = u0.to(DType::f64).requires_grad_();
    const Tensor y1 = llm::gated_activation(g1, u1, llm::GatedAct::gelu_tanh).to(Device::cpu());
    const Tensor y2 = mul(gelu(g2, GeluApprox::tanh), u2);
    const Tensor y3 = llm::gated_activation(g3, u3, llm::GatedAct::gelu_tanh);
    sum(y1 * probe).backward();
    sum(y2 * probe).backward();
    sum(y3 * probe.to(DType::f64)).backward();
    // Within f32 rounding: the vector tanh's few ulps (more where 1 + tanh
    // cancels, far below zero) under 4e-6 of the largest value.
    CHECK(rel_diff(y1, y3) < 1e-6);
    CHECK(rel_diff(g1.grad().to(Device::cpu()), g3.grad()) < 4e-6);
    CHECK(rel_diff(u1.grad().to(Device::cpu()), u3.grad()) < 1e-6);
    CHECK(rel_diff(y1, y2) < 1e-6);
    CHECK(rel_diff(g1.grad().to(Device::cpu()), g2.grad()) < 4e-6);
    CHECK(rel_diff(u1.grad().to(Device::cpu()), u2.grad()) < 1e-6);
    // The f64 op against the formula.
    const std::vector<double> gv = g0.to_vector<double>(), uv = u0.to_vector<double>(),
                              yv = y3.to_vector<double>();
    double worst = 0;
    for (size_t i = 0; i < gv.size(); ++i)
      worst = std::max(worst, std::fabs(yv[i] - gelu_tanh(gv[i]) * uv[i]));
    CHECK(worst < 1e-13);
  }
}

TEST_CASE("gated_activation gelu_tanh: 16-bit data rounds as transformers' bf16 GemmaMLP does") {
  // gelu(gate) is a bf16 tensor before the product; the backward rounds g up
  // (mul's gradient) and forms gelu's slope in f32.
  Generator gen(9);
  const Tensor gate = (randn({64, 40}, gen) * 3.0).to(DType::bf16),
               up = randn({64, 40}, gen).to(DType::bf16), g = randn({64, 40}, gen).to(DType::bf16);
  Tensor gt = gate.clone().requires_grad_(), ut = up.clone().requires_grad_();
  const Tensor y = llm::gated_activation(gt, ut, llm::GatedAct::gelu_tanh);
  y.backward(g);
  const Tensor x = gate.to(DType::f32), u = up.to(DType::f32), gf = g.to(DType::f32);
  const double beta = std::sqrt(2 / M_PI), kappa = 0.044715;
  const Tensor t = tanh((x + x * x * x * kappa) * beta);
  const Tensor act_bf16 = (x * 0.5 * (t + 1.0)).to(DType::bf16).to(DType::f32);
  const Tensor slope =
      (t + 1.0) * 0.5 + x * 0.5 * (1.0 - t * t) * ((x * x * (3 * kappa) + 1.0) * beta);
  const Tensor want_y = (act_bf16 * u).to(DType::bf16);
  const Tensor want_up = (gf * act_bf16).to(DType::bf16);
  const Tensor want_gate = ((gf * u).to(DType::bf16).to(DType::f32) * slope).to(DType::bf16);
  CHECK(rel_diff(y, want_y) <= 1.0 / 256);
  CHECK(rel_diff(gt.grad(), want_gate) <= 1.0 / 256);
  CHECK(rel_diff(ut.grad(), want_up) <= 1.0 / 256);
  // Equal bits but where tanh's last bits differ (Eigen's vector tanh here,
  // libm's in the reference, Sleef's in PyTorch) and 1 + tanh cancels them
  // into a bf16 step: gates far below zero, whose values are near 0.
  CHECK(mean(eq(y.to(DType::f32), want_y.to(DType::f32)).to(DType::f32)).item() > 0.97);
}

TEST_CASE("swiglu: mul(silu(gate), up)'s values and gradients in one pass, holding less") {
  Generator gen(3);
  // 6001 values: pieces of 1024 and a ragged last one.
  const Tensor g0 = randn({353, 17}, gen) * 4.0, u0 = randn({353, 17}, gen),
               probe = randn({353, 17}, gen);
  Tensor g1 = g0.clone().requires_grad_(), u1 = u0.clone().requires_grad_();
  Tensor g2 = g0.clone().requires_grad_(), u2 = u0.clone().requires_grad_();
  Tensor g3 = g0.to(DType::f64).requires_grad_(), u3 = u0.to(DType::f64).requires_grad_();
  const Tensor y1 = llm::swiglu(g1, u1), y2 = mul(silu(g2), u2), y3 = llm::swiglu(g3, u3);
  sum(y1 * probe).backward();
  sum(y2 * probe).backward();
  sum(y3 * probe.to(DType::f64)).backward();
  // Within f32 rounding of the f64 op and of the two f32 ops it replaces
  // (the backward forms sigmoid as 1 / (1 + exp(-x)), PyTorch's
  // silu_backward, where sigmoid's op takes exp(-|x|)).
  CHECK(rel_diff(y1, y3) < 1e-6);
  CHECK(rel_diff(g1.grad(), g3.grad()) < 1e-6);
  CHECK(rel_diff(u1.grad(), u3.grad()) < 1e-6);
  CHECK(rel_diff(y1, y2) < 1e-6);
  CHECK(rel_diff(g1.grad(), g2.grad()) < 1e-6);
  CHECK(rel_diff(u1.grad(), u2.grad()) < 1e-6);
  // The f64 op against the formula in f64 (the harness checks its
  // gradients by finite differences).
  const Tensor gd = g0.to(DType::f64), ud = u0.to(DType::f64);
  CHECK(rel_diff(y3, gd / (1.0 + exp(-gd)) * ud) < 1e-14);
  // Far below zero exp(-x) overflows: silu's limit, -0, and no NaN.
  const Tensor far = full({3}, -200.0).requires_grad_(), one = ones({3}).requires_grad_();
  const Tensor yf = llm::swiglu(far, one);
  sum(yf).backward();
  CHECK(max(abs(yf)).item() == 0);
  CHECK(max(abs(far.grad())).item() == 0);
  CHECK(max(abs(one.grad())).item() == 0);
}

TEST_CASE("swiglu: 16-bit data rounds as transformers' bf16 MLP does") {
  // silu(gate) is a bf16 tensor before the product; the backward rounds g up
  // (mul's gradient) and forms the rest in f32 (silu's backward).
  Generator gen(5);
  const Tensor gate = (randn({64, 40}, gen) * 3.0).to(DType::bf16),
               up = randn({64, 40}, gen).to(DType::bf16), g = randn({64, 40}, gen).to(DType::bf16);
  Tensor gt = gate.clone().requires_grad_(), ut = up.clone().requires_grad_();
  const Tensor y = llm::swiglu(gt, ut);
  y.backward(g);
  const Tensor x = gate.to(DType::f32), u = up.to(DType::f32), gf = g.to(DType::f32);
  const Tensor silu_bf16 = (x / (1.0 + exp(-x))).to(DType::bf16).to(DType::f32);
  const Tensor s = 1.0 / (1.0 + exp(-x));
  const Tensor want_y = (silu_bf16 * u).to(DType::bf16);
  const Tensor want_up = (gf * silu_bf16).to(DType::bf16);
  const Tensor want_gate =
      ((gf * u).to(DType::bf16).to(DType::f32) * (s * (1.0 + x * (1.0 - s)))).to(DType::bf16);
  // The same roundings; exp's own last bit may move a value across a bf16
  // rounding boundary, so at most one bf16 step (2^-8 of the magnitude).
  CHECK(rel_diff(y, want_y) <= 1.0 / 256);
  CHECK(rel_diff(gt.grad(), want_gate) <= 1.0 / 256);
  CHECK(rel_diff(ut.grad(), want_up) <= 1.0 / 256);
  const double same = mean(eq(y.to(DType::f32), want_y.to(DType::f32)).to(DType::f32)).item();
  CHECK(same > 0.99);
}

TEST_CASE("swiglu: the graph holds gate and up only") {
  Generator gen(4);
  // Large inputs (cached blocks, counted where the cache is on): the graph
  // holds the output only, no silu(gate).
  const Tensor gate = randn({1024, 1024}, gen).requires_grad_(),
               up = randn({1024, 1024}, gen).requires_grad_();  // 4 MiB each
  const std::size_t before = cpu::block_cache_stats().in_use;
  const Tensor y = llm::swiglu(gate, up);
  if (cpu::block_cache_stats().bound > 0)
    CHECK(cpu::block_cache_stats().in_use == before + y.nbytes());
}

TEST_CASE("swiglu: clear errors") {
  CHECK_THROWS_WITH_AS(llm::swiglu(zeros({2, 3}), zeros({3, 2})),
                       doctest::Contains("[gated_activation] gate and up must share shape"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(
      llm::swiglu(zeros({2}, {.dtype = DType::i64}), zeros({2}, {.dtype = DType::i64})),
      doctest::Contains("gated_activation"), std::invalid_argument);
}
