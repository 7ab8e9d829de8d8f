// PiSSA's and OLoRA's starts (residual_init.h): the factors are the
// weight's leading singular triplets or QR columns, the residual is what they
// leave, a start given back rebuilds the same residual bit for bit, and in a
// bf16 model the adapters hold the factors rounded while the residual keeps
// them whole. And the orthogonal start of LoRALinear: B A = 0, neither zero.
#include <doctest/doctest.h>

#include <cmath>

#include "quant/nf4/nf4_modules.h"
#include "quant/nf4/residual_init.h"
#include "quanta.h"
#include "support/relative_error.h"

using namespace quanta;
using namespace quanta::quant;
using quanta::testing::max_abs;
using quanta::testing::max_rel_diff;

TEST_CASE("PiSSA's start: scaling B A is the weight's top-r part, the residual the rest") {
  Generator gen(31);
  const Tensor w = randn({24, 40}, gen) * 0.1;
  const double scaling = 2.0;
  const std::vector<ResidualStart> starts = pissa_starts({{w, 3, scaling}});
  REQUIRE(starts.size() == 1);
  const ResidualStart& s = starts[0];
  CHECK(s.lora_A.shape() == Shape{3, 40});
  CHECK(s.lora_B.shape() == Shape{24, 3});
  const SingularTriplets t = top_singular_triplets(w, 3);
  const Tensor top = matmul(t.u * unsqueeze(t.s, 0), t.vh);
  CHECK(max_rel_diff(matmul(s.lora_B, s.lora_A) * scaling, top) < 1e-5);
  // A = sqrt(S / scaling) Vh: the factors share the values evenly.
  CHECK(max_rel_diff(s.lora_A, unsqueeze(sqrt(t.s / scaling), 1) * t.vh) < 1e-6);
  CHECK(max_rel_diff(s.residual, w - top) < 1e-5);
  CHECK(max_rel_diff(s.residual + matmul(s.lora_B, s.lora_A) * scaling, w) < 1e-6);
  // Without rounding the adapters are the factors taken out.
  CHECK(max_abs(s.taken_A - s.lora_A) == 0);
  // The residual's largest singular value is the weight's (r + 1)-th.
  const SingularTriplets all = top_singular_triplets(w, 4);
  CHECK(top_singular_triplets(s.residual, 1).s.item() ==
        doctest::Approx(all.s.to_vector<float>()[3]).epsilon(1e-4));
}

TEST_CASE("PiSSA's start with niter: the randomized decomposition's, replayable") {
  Generator gen(8);
  // A spectrum that falls off: the sketch finds the leading part.
  const Tensor w = matmul(randn({32, 4}, gen), randn({4, 48}, gen)) + randn({32, 48}, gen) * 1e-3;
  std::vector<Generator> gens{Generator(3)}, again{Generator(3)};
  const ResidualStart approx = pissa_starts({{w, 4, 1.0}}, 2, &gens)[0];
  const ResidualStart exact = pissa_starts({{w, 4, 1.0}})[0];
  CHECK(max_rel_diff(matmul(approx.lora_B, approx.lora_A), matmul(exact.lora_B, exact.lora_A)) <
        1e-3);
  CHECK(max_abs(pissa_starts({{w, 4, 1.0}}, 2, &again)[0].lora_A - approx.lora_A) == 0);
  CHECK_THROWS_WITH_AS(pissa_starts({{w, 4, 1.0}}, 2), doctest::Contains("one generator per layer"),
                       std::invalid_argument);
}

TEST_CASE("OLoRA's start: B and A the QR's leading columns and rows, whatever the scaling") {
  Generator gen(12);
  const Tensor w = randn({20, 30}, gen);
  const ResidualStart s = olora_starts({{w, 5, 0.5}})[0];
  const ThinQR f = thin_qr(w);
  CHECK(max_abs(s.lora_B - narrow(f.q, 1, 0, 5)) == 0);
  CHECK(max_abs(s.lora_A - narrow(f.r, 0, 0, 5)) == 0);
  CHECK(max_rel_diff(s.residual, w - matmul(s.lora_B, s.lora_A) * 0.5) < 1e-6);
  // B's columns are orthonormal: OLoRA's point.
  CHECK(max_abs(matmul(transpose(s.lora_B, 0, 1), s.lora_B) - eye(5)) < 1e-5);
}

TEST_CASE("Residual starts: bf16 adapters hold the factors rounded, the residual keeps them") {
  Generator gen(5);
  const Tensor w = randn({16, 32}, gen) * 0.2;
  for (const bool pissa : {true, false}) {
    INFO((pissa ? "pissa" : "olora"));
    const ResidualStartLayer layer{w, 2, 1.5, DType::bf16};
    const ResidualStart s = pissa ? pissa_starts({layer})[0] : olora_starts({layer})[0];
    CHECK(max_abs(s.lora_A - s.taken_A.to(DType::bf16).to(DType::f32)) == 0);
    CHECK(max_abs(s.lora_A - s.taken_A) > 0);
    CHECK(max_abs(s.residual - (w - matmul(s.taken_B, s.taken_A) * 1.5)) == 0);
    // Given back (as a saved folder keeps them), the taken factors rebuild
    // the same residual, bit for bit.
    const ResidualStart back = given_start(layer, s.taken_A, s.taken_B);
    CHECK(max_abs(back.residual - s.residual) == 0);
    CHECK(max_abs(back.lora_A - s.lora_A) == 0);
  }
  CHECK_THROWS_WITH_AS(given_start({w, 2, 1.0}, zeros({3, 32}), zeros({16, 2})),
                       doctest::Contains("A [3, 32] and B [16, 2] for a [16, 32] weight"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(pissa_starts({{w, 2, 1.0}, {w, 17, 1.0}}),
                       doctest::Contains("layer 1: rank 17 is outside [1, 16]"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(olora_starts({{zeros({4}), 1, 1.0}}),
                       doctest::Contains("the weight must be a matrix"), std::invalid_argument);
}

TEST_CASE("LoRA init: PEFT's orthogonal start has B A = 0 and neither factor zero") {
  Generator gen(2);
  const auto base =
      std::make_shared<NF4Linear>(quantize_nf4(randn({48, 64}, gen) * 0.05), Tensor());
  const LoRALinear layer(base, {.rank = 8, .seed = 6, .init = LoRAInit::orthogonal});
  CHECK(max_abs(layer.lora_A()) > 0.01);
  CHECK(max_abs(layer.lora_B()) > 0.01);
  // Q's even and odd rows are orthogonal: the product vanishes to rounding.
  CHECK(max_abs(matmul(layer.lora_B(), layer.lora_A())) <
        1e-6 * max_abs(layer.lora_A()) * max_abs(layer.lora_B()) * 64);
  // The scale PEFT gives: N(0, 1) draws times unit rows, over 10.
  CHECK(max_abs(layer.lora_A()) < 1.0);
  const LoRALinear same(base, {.rank = 8, .seed = 6, .init = LoRAInit::orthogonal});
  CHECK(max_abs(same.lora_B() - layer.lora_B()) == 0);
  CHECK_THROWS_WITH_AS(LoRALinear(base, {.rank = 3, .init = LoRAInit::orthogonal}),
                       doctest::Contains("the orthogonal start needs an even rank, got 3"),
                       std::invalid_argument);
}

TEST_CASE("LoRALinear keeps the start taken out of its base, on the host") {
  Generator gen(3);
  const auto base = std::make_shared<NF4Linear>(quantize_nf4(randn({8, 16}, gen)), Tensor());
  LoRALinear layer(base, {.rank = 2});
  CHECK_FALSE(layer.initial_lora_A().defined());
  const Tensor a = randn({2, 16}, gen, {.dtype = DType::f64});
  layer.set_initial_adapters(a, randn({8, 2}, gen));
  CHECK(layer.initial_lora_A().dtype() == DType::f32);
  CHECK(layer.initial_lora_A().device() == Device::cpu());
  CHECK(max_rel_diff(layer.initial_lora_A(), a) < 1e-7);
  // Outside the state dict: a checkpoint does not carry it.
  for (const auto& [name, t] : layer.state_dict()) CHECK(name.find("initial") == std::string::npos);
  CHECK_THROWS_WITH_AS(layer.set_initial_adapters(zeros({8, 2}), zeros({2, 16})),
                       doctest::Contains("set_initial_adapters: A [8, 2] and B [2, 16]"),
                       std::invalid_argument);
}
