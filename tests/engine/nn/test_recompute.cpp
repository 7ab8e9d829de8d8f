// recompute: the same values and gradients as the plain call (bit for bit,
// dropout draws included), gradients reaching parameters once, the f64
// finite-difference check, and the plain call when nothing needs a gradient.
#include <doctest/doctest.h>

#include <cmath>

#include "quanta.h"

using namespace quanta;

namespace {

// Linear, then a dropout drawn from the module's own stream, then tanh and a
// second Linear: what a decoder layer with LoRA dropout looks like to
// recompute.
struct NoisyBlock : Module {
  std::shared_ptr<Linear> first, second;
  Generator stream{11};
  double p;
  NoisyBlock(Generator& gen, DType dtype, double drop) : Module("NoisyBlock"), p(drop) {
    first = register_module("first", std::make_shared<Linear>(4, 6, gen));
    second = register_module("second", std::make_shared<Linear>(6, 3, gen));
    to(dtype);
  }
  std::vector<Generator*> own_random_streams() override { return {&stream}; }
  Tensor forward(const Tensor& x) override {
    Tensor h = first->forward(x);
    if (p > 0)
      h = mul(h, bernoulli(h.shape(), 1.0 - p, stream, {.dtype = h.dtype()}) * (1.0 / (1.0 - p)));
    return second->forward(tanh(h));
  }
};

std::vector<double> values(const Tensor& t) { return t.to(DType::f64).to_vector<double>(); }

}  // namespace

TEST_CASE("recompute equals the plain call: values, input and parameter gradients, draws") {
  for (const DType dtype : {DType::f32, DType::f64}) {
    INFO("dtype ", dtype_name(dtype));
    Generator gen(3);
    NoisyBlock block(gen, dtype, 0.3);
    const Tensor x0 = randn({5, 4}, gen).to(dtype);

    const GeneratorState start = block.stream.state();
    const Tensor x = x0.clone().requires_grad_(true);
    const Tensor plain = block.forward(x);
    sum(mul(plain, plain)).backward();
    const GeneratorState after_plain = block.stream.state();
    std::vector<std::vector<double>> plain_grads;
    for (const Tensor& p : block.parameters()) plain_grads.push_back(values(p.grad()));
    const std::vector<double> plain_x = values(x.grad());

    block.zero_grad();
    block.stream.set_state(start);
    const Tensor y = x0.clone().requires_grad_(true);
    const Tensor again = recompute(block, y);
    CHECK(again.requires_grad());
    CHECK(values(again) == values(plain));
    // The forward drew once; the backward's replay leaves the stream there.
    CHECK(block.stream.state().offset.lo == after_plain.offset.lo);
    sum(mul(again, again)).backward();
    CHECK(block.stream.state().offset.lo == after_plain.offset.lo);
    CHECK(values(y.grad()) == plain_x);
    const std::vector<Tensor> params = block.parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      INFO("parameter ", i);
      CHECK(values(params[i].grad()) == plain_grads[i]);
    }
  }
}

TEST_CASE("recompute: recomputing() is true while the backward runs the function again") {
  std::vector<bool> seen;
  const auto fn = [&](const Tensor& x) {
    seen.push_back(recomputing());
    return x * 2.0;
  };
  const Tensor x = ones({3}).requires_grad_(true);
  const Tensor y = recompute(fn, x, {});
  CHECK_FALSE(recomputing());
  sum(y).backward();
  CHECK(seen == std::vector<bool>{false, true});
  CHECK_FALSE(recomputing());
  CHECK(x.grad().to_vector<float>() == std::vector<float>{2, 2, 2});
}

TEST_CASE("recompute: f64 central differences, input and parameters") {
  Generator gen(5);
  NoisyBlock block(gen, DType::f64, 0.0);
  const Tensor x = randn({3, 4}, gen).to(DType::f64).requires_grad_(true);
  const auto loss = [&](const Tensor& in) {
    return sum(mul(recompute(block, in), sum(in, {1}, true)));
  };
  loss(x).backward();
  const double eps = 1e-6;
  const auto check = [&](const Tensor& t, const char* what) {
    INFO(what);
    const std::vector<double> analytic = values(t.grad());
    for (int64_t i = 0; i < t.numel(); ++i) {
      Tensor flat = reshape(t.detach(), {t.numel()});
      const double v = flat.to_vector<double>()[i];
      NoGradGuard no_grad;
      copy_(select(flat, 0, i), full({}, v + eps, {.dtype = DType::f64}));
      const double up = loss(x.detach()).to_vector<double>()[0];
      copy_(select(flat, 0, i), full({}, v - eps, {.dtype = DType::f64}));
      const double down = loss(x.detach()).to_vector<double>()[0];
      copy_(select(flat, 0, i), full({}, v, {.dtype = DType::f64}));
      CHECK(std::abs((up - down) / (2 * eps) - analytic[i]) <
            1e-7 * std::max(1.0, std::abs(analytic[i])));
    }
  };
  check(x, "input");
  check(block.first->weight(), "first.weight");
  check(block.second->bias(), "second.bias");
}

TEST_CASE(
    "recompute: a frozen input still trains the parameters; nothing to train is a plain call") {
  Generator gen(9);
  NoisyBlock block(gen, DType::f32, 0.0);
  Tensor x = randn({2, 4}, gen);  // no grad: the first layer of a frozen model
  sum(recompute(block, x)).backward();
  CHECK(block.first->weight().grad().defined());
  CHECK(block.second->bias().grad().defined());

  for (Tensor p : block.parameters()) p.requires_grad_(false);
  const Tensor out = recompute(block, x);
  CHECK_FALSE(out.requires_grad());
  NoGradGuard no_grad;
  CHECK(values(recompute(block, x.requires_grad_(true))) == values(block.forward(x)));
}
