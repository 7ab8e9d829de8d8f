// DoRA on LoRALinear (LoRAOptions::use_dora): the layer starts as its base,
// merges, round-trips its state, forms PEFT's extra frozen product of the
// dropped input in training, and its f64 gradients match finite differences
// (the rows' norm held constant for A and B, as PEFT detaches it).
#include <doctest/doctest.h>

#include "quant/nf4/nf4_modules.h"
#include "quanta.h"
#include "support/numeric_grad.h"

using namespace quanta;
using namespace quanta::quant;
using quanta::testing::numeric_grad;

namespace {

double max_abs_diff(const Tensor& a, const Tensor& b) {
  return max(abs(a.to(DType::f64) - b.to(DType::f64))).item();
}

// A DoRA layer [out 12, in 40] with a bias, B and the magnitude moved off
// their initial values so that every term of the output is non-zero.
std::shared_ptr<LoRALinear> dora_layer(Generator& gen, DType dtype, double dropout) {
  Linear lin(40, 12, gen);
  // An f64 layer's bias is f64, as an f64 model's is.
  auto layer = std::make_shared<LoRALinear>(
      std::make_shared<NF4Linear>(quantize_nf4(lin.weight().detach()),
                                  lin.bias().detach().to(dtype)),
      LoRAOptions{.rank = 3, .alpha = 6, .dropout = dropout, .dtype = dtype, .use_dora = true});
  NoGradGuard no_grad;
  copy_(layer->lora_B(), randn(layer->lora_B().shape(), gen, {.dtype = dtype}) * 0.1);
  copy_(layer->magnitude(), layer->magnitude() * (1.0 + randn({12}, gen, {.dtype = dtype}) * 0.1));
  return layer;
}

// PEFT's DoRA output written out with the norm given: y + (k - 1)(frozen
// term) + k (x_dropped A^T B^T) s, k = m / norm, where the frozen term is
// y - bias, or the dropped input's product with the dequantized weight.
Tensor dora_reference(LoRALinear& layer, const Tensor& x, const Tensor& norm,
                      const Tensor& dropped) {
  const Tensor y = (*layer.base())(x);
  const Tensor k = layer.magnitude() / norm;
  const Tensor w = layer.base()->dequantized_weight().to(x.dtype());
  const Tensor frozen =
      dropped.defined() ? linear(dropped, w) : y - layer.base()->bias().to(y.dtype());
  const Tensor in = dropped.defined() ? dropped : x;
  return y + (k - 1.0) * frozen +
         k * linear(linear(in, layer.lora_A()), layer.lora_B()) * layer.scaling();
}

}  // namespace

TEST_CASE("DoRA: starts as its base, merges, and its state round-trips") {
  Generator gen(71);
  Linear lin(40, 12, gen);
  auto base = std::make_shared<NF4Linear>(lin);
  LoRALinear layer(base, {.rank = 3, .alpha = 6, .seed = 2, .use_dora = true});
  REQUIRE(layer.use_dora());
  // B = 0: the magnitude is the rows' norms of W, so k = 1 exactly.
  const Tensor w = base->dequantized_weight();
  CHECK(max_abs_diff(layer.magnitude(), sqrt(sum(square(w), {1}))) < 1e-6);
  const Tensor x = randn({5, 40}, gen);
  CHECK(max_abs_diff(layer(x), (*base)(x)) == 0.0);

  auto moved = dora_layer(gen, DType::f32, 0.0);
  moved->eval();
  const Tensor out = (*moved)(x);
  // The merged weight's rows are the adapted rows rescaled to the magnitude.
  const Tensor merged = moved->merged_weight();
  CHECK(max_abs_diff(sqrt(sum(square(merged), {1})), moved->magnitude()) < 1e-5);
  CHECK(max_abs_diff((*moved->merge())(x), out) < 1e-5);
  CHECK(max_abs_diff(out, dora_reference(*moved, x, moved->weight_norm(), Tensor())) < 1e-5);

  std::vector<std::string> names;
  for (const auto& [n, t] : moved->adapter_tensors()) names.push_back(n);
  CHECK(names ==
        std::vector<std::string>{"lora_A.weight", "lora_B.weight", "lora_magnitude_vector"});
  const StateDict sd = moved->state_dict();
  CHECK(sd.size() == 5);  // lora_A, lora_B, lora_magnitude_vector, base.weight, base.bias
  LoRALinear other(std::make_shared<NF4Linear>(quantize_nf4(zeros({12, 40})), zeros({12})),
                   {.rank = 3, .alpha = 6, .seed = 5, .use_dora = true});
  other.load_state_dict(io::parse_safetensors(io::serialize_safetensors(sd)).tensors);
  other.eval();
  CHECK(max_abs_diff(other(x), out) == 0.0);
}

TEST_CASE("DoRA: a kept norm is taken once, until turned off") {
  Generator gen(75);
  auto layer = dora_layer(gen, DType::f32, 0.0);
  layer->eval();
  const Tensor x = randn({5, 40}, gen);
  const Tensor taken = (*layer)(x);
  layer->keep_weight_norm(true);
  CHECK(max_abs_diff((*layer)(x), taken) == 0.0);
  {
    NoGradGuard no_grad;
    copy_(layer->lora_B(), layer->lora_B() * 2.0);
  }
  // Kept: the norm of the B before (what inference may rely on, and
  // training must not).
  const Tensor stale = (*layer)(x);
  layer->keep_weight_norm(false);
  const Tensor fresh = (*layer)(x);
  CHECK(max_abs_diff(fresh, dora_reference(*layer, x, layer->weight_norm(), Tensor())) < 1e-5);
  CHECK(max_abs_diff(stale, fresh) > 1e-4);
}

TEST_CASE("DoRA: training with dropout multiplies the dropped input by the frozen weight too") {
  Generator gen(72);
  auto layer = dora_layer(gen, DType::f32, 0.3);
  layer->train();
  const Tensor x = randn({6, 40}, gen);
  const GeneratorState before = layer->dropout_generator().state();
  const Tensor out = (*layer)(x);
  Generator replay(before);
  const Tensor dropped = dropout(x, 0.3, true, replay);
  CHECK(max_abs_diff(out, dora_reference(*layer, x, layer->weight_norm(), dropped)) < 1e-5);
  // Without the drop the frozen term would be y - bias: the two differ.
  CHECK(max_abs_diff(out, dora_reference(*layer, x, layer->weight_norm(), Tensor())) > 1e-3);
}

TEST_CASE(
    "DoRA: f64 gradients of x and the magnitude by finite differences; A and B with the "
    "rows' norm held") {
  for (const double p : {0.0, 0.25}) {
    CAPTURE(p);
    Generator gen(73);
    auto layer = dora_layer(gen, DType::f64, p);
    layer->train();
    const Tensor x = randn({4, 40}, gen, {.dtype = DType::f64});
    const Tensor probe = randn({4, 12}, gen, {.dtype = DType::f64});
    const GeneratorState draws = layer->dropout_generator().state();
    // The same dropout draws in every evaluation.
    const auto loss_of = [&](const Tensor& input) {
      layer->dropout_generator().set_state(draws);
      return sum((*layer)(input)*probe);
    };
    const Tensor xg = x.clone().requires_grad_();
    loss_of(xg).backward();
    const double tol = 1e-6;
    CHECK(max_abs_diff(xg.grad(), numeric_grad([&](const Tensor& in) { return loss_of(in).item(); },
                                               x)) < tol);
    CHECK(max_abs_diff(layer->magnitude().grad(),
                       numeric_grad(layer->magnitude(), [&] { return loss_of(x).item(); })) < tol);
    // A and B: the norm is a constant of the backward.
    const Tensor norm = layer->weight_norm();
    const auto held = [&] {
      layer->dropout_generator().set_state(draws);
      Generator replay(draws);
      const Tensor dropped = p > 0 ? dropout(x, p, true, replay) : Tensor();
      return sum(dora_reference(*layer, x, norm, dropped) * probe).item();
    };
    CHECK(max_abs_diff(layer->lora_A().grad(), numeric_grad(layer->lora_A(), held)) < tol);
    CHECK(max_abs_diff(layer->lora_B().grad(), numeric_grad(layer->lora_B(), held)) < tol);
  }
}

TEST_CASE("DoRA: a layer whose output is not read still computes the frozen term it needs") {
  // Under UnreadOutputGuard (a recomputed decoder layer's last projection)
  // the plain NF4 product gives zeros; DoRA's magnitude gradient reads it.
  // In training with dropout both frozen products are read.
  for (const double p : {0.0, 0.25}) {
    CAPTURE(p);
    Generator gen(74);
    auto layer = dora_layer(gen, DType::f32, p);
    layer->train();
    const Tensor x = randn({5, 40}, gen);
    const Tensor probe = randn({5, 12}, gen);
    const GeneratorState draws = layer->dropout_generator().state();
    sum((*layer)(x)*probe).backward();
    const Tensor want = layer->magnitude().grad().clone();
    layer->zero_grad();
    layer->dropout_generator().set_state(draws);
    {
      UnreadOutputGuard unread;
      sum((*layer)(x)*probe).backward();
    }
    CHECK(max_abs_diff(layer->magnitude().grad(), want) == 0.0);
  }
}
