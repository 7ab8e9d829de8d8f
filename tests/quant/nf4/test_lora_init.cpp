// How LoRALinear's adapters start (LoRAOptions::init: PEFT's true,
// "gaussian" and false), set_adapters, and LoftQ's start (loftq_init): the
// scaled product is the quantization error's best rank-r matrix, whatever
// lora_alpha, and a DoRA layer still computes base + s B A.
#include <doctest/doctest.h>

#include <cmath>

#include "quant/nf4/loftq.h"
#include "quant/nf4/nf4_modules.h"
#include "quanta.h"
#include "support/relative_error.h"

using namespace quanta;
using namespace quanta::quant;
using quanta::testing::max_rel_diff;

namespace {

double max_abs(const Tensor& t) { return max(abs(t.to(DType::f64))).item(); }

// The diagonal matrix of the vector s.
Tensor diag_of(const Tensor& s) {
  return eye(s.numel(), -1, {.dtype = s.dtype()}) * unsqueeze(s, 0);
}

std::shared_ptr<NF4Linear> nf4_base(const Tensor& weight) {
  return std::make_shared<NF4Linear>(quantize_nf4(weight), Tensor());
}

}  // namespace

TEST_CASE("LoRA init: PEFT's true, gaussian and false") {
  Generator gen(3);
  const auto base = nf4_base(randn({64, 512}, gen) * 0.05);
  const LoRALinear kaiming(base, {.rank = 8, .seed = 4});
  const LoRALinear gaussian(base, {.rank = 8, .seed = 4, .init = LoRAInit::gaussian});
  const LoRALinear random(base, {.rank = 8, .seed = 4, .init = LoRAInit::both_random});
  // true: A uniform within nn.Linear's bound 1 / sqrt(in), B zero.
  CHECK(max_abs(kaiming.lora_A()) <= 1 / std::sqrt(512.0));
  CHECK(max_abs(kaiming.lora_B()) == 0);
  // gaussian: A normal with std 1 / r (4096 draws), B zero.
  const double m = mean(gaussian.lora_A()).item();
  const double sd = std::sqrt(mean(square(gaussian.lora_A() - m)).item());
  CHECK(std::abs(m) < 0.01);
  CHECK(sd == doctest::Approx(1.0 / 8).epsilon(0.05));
  CHECK(max_abs(gaussian.lora_A()) > 1 / std::sqrt(512.0));  // not the uniform's range
  CHECK(max_abs(gaussian.lora_B()) == 0);
  // false: both drawn as nn.Linear draws them, B within 1 / sqrt(r).
  CHECK(random.lora_A().to_vector<float>() == kaiming.lora_A().to_vector<float>());
  CHECK(max_abs(random.lora_B()) > 0);
  CHECK(max_abs(random.lora_B()) <= 1 / std::sqrt(8.0));
  // The same seed and stream draw the same adapters.
  const LoRALinear again(base, {.rank = 8, .seed = 4, .init = LoRAInit::gaussian});
  CHECK(again.lora_A().to_vector<float>() == gaussian.lora_A().to_vector<float>());
}

TEST_CASE("LoRA init: set_adapters replaces A and B, and DoRA's magnitude follows") {
  Generator gen(8);
  const Tensor w = randn({12, 40}, gen) * 0.1;
  const Tensor a = randn({3, 40}, gen, {.dtype = DType::f64}) * 0.2;
  const Tensor b = randn({12, 3}, gen, {.dtype = DType::f64}) * 0.2;
  const Tensor x = randn({5, 40}, gen, {.dtype = DType::f64});
  LoRALinear plain(nf4_base(w), {.rank = 3, .alpha = 6, .dtype = DType::f64});
  LoRALinear dora(nf4_base(w), {.rank = 3, .alpha = 6, .dtype = DType::f64, .use_dora = true});
  plain.set_adapters(a, b);
  dora.set_adapters(a.to(DType::f32), b);  // converted to the adapters' dtype
  CHECK(plain.lora_A().dtype() == DType::f64);
  CHECK(max_abs(plain.lora_A() - a) == 0);
  CHECK(max_abs(plain.lora_B() - b) == 0);
  NoGradGuard no_grad;
  const Tensor want = plain.base()->dequantized_weight().to(DType::f64) + matmul(b, a) * 2.0;
  CHECK(max_rel_diff(plain.merged_weight(), want) < 1e-6);
  // m = ||W + s B A|| per row: the DoRA layer computes the same output.
  CHECK(max_rel_diff(dora(x), plain(x)) < 1e-6);
  CHECK_THROWS_WITH_AS(plain.set_adapters(b, a),
                       doctest::Contains("set_adapters: A [12, 3] and B [3, 40] for adapters A "
                                         "[3, 40] and B [12, 3]"),
                       std::invalid_argument);
}

TEST_CASE("LoftQ: the scaled product is the quantization error's best rank-r matrix") {
  Generator gen(21);
  const Tensor w = randn({48, 64}, gen, {.dtype = DType::f64}) * 0.05;
  const auto base = nf4_base(w.to(DType::f32));
  const Tensor error = w - base->dequantized_weight().to(DType::f64);
  const SingularTriplets svd = top_singular_triplets(error, 48);
  for (const double alpha : {4.0, 16.0}) {
    for (const bool rslora : {false, true}) {
      INFO("alpha ", alpha, rslora ? ", rslora" : "");
      LoRALinear layer(base,
                       {.rank = 4, .alpha = alpha, .use_rslora = rslora, .dtype = DType::f64});
      const QuantizationErrorChange e = loftq_init(layer, w);
      NoGradGuard no_grad;
      const Tensor correction = matmul(layer.lora_B(), layer.lora_A()) * layer.scaling();
      const Tensor rest = error - correction;
      // The squared error before and after: all singular values' squares,
      // then those past the fourth.
      CHECK(e.before == doctest::Approx(sum(square(error)).item()).epsilon(1e-12));
      CHECK(e.after == doctest::Approx(sum(square(rest)).item()).epsilon(1e-10));
      CHECK(e.after == doctest::Approx(sum(square(slice(svd.s, 0, 4, 48))).item()).epsilon(1e-10));
      CHECK(e.after < e.before);
      // What is left is orthogonal to the correction's columns and rows.
      CHECK(max_abs(matmul(transpose(layer.lora_B(), 0, 1), rest)) < 1e-12);
      CHECK(max_abs(matmul(rest, transpose(layer.lora_A(), 0, 1))) < 1e-12);
      // The factors are balanced: A A^T = B^T B = S / scaling.
      const Tensor s = slice(svd.s, 0, 0, 4) / layer.scaling();
      CHECK(max_rel_diff(matmul(layer.lora_A(), transpose(layer.lora_A(), 0, 1)), diag_of(s)) <
            1e-10);
      CHECK(max_rel_diff(matmul(transpose(layer.lora_B(), 0, 1), layer.lora_B()), diag_of(s)) <
            1e-10);
    }
  }
  LoRALinear layer(base, {.rank = 4});
  CHECK_THROWS_WITH_AS(loftq_init(layer, transpose(w, 0, 1)),
                       doctest::Contains("the float weight is [64, 48], the layer's base [48, 64]"),
                       std::invalid_argument);
}
