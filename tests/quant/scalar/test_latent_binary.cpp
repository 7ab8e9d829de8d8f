// LatentQuantize and BinaryMapper.
#include <doctest/doctest.h>

#include <cmath>

#include "quant/scalar/binary_mapper.h"
#include "quant/scalar/latent_quantize.h"
#include "scalar_test_util.h"

using namespace quanta;
using namespace quanta::quant;
using namespace scalar_test;

TEST_CASE("LatentQuantize snaps to per-dimension grids and round-trips indices") {
  Generator gen(1);
  LatentQuantizeOptions o;
  o.levels = {5, 4, 3};
  LatentQuantize lq(o, gen);
  CHECK(lq.codebook_size() == 60);
  const Tensor x = (randn({2, 20, 3}, gen) * 0.5).requires_grad_();
  const QuantizeOutput out = lq.forward(x, Tensor());
  CHECK(out.indices.dtype() == DType::i32);
  CHECK(out.indices.shape() == Shape{2, 20});
  CHECK(max_abs_diff(lq.indices_to_codes(out.indices), out.quantized) == 0.0);
  // every value is one of its dimension's grid values, and the nearest one
  const auto q = vals(out.quantized), xv = vals(x);
  for (size_t t = 0; t < q.size(); ++t) {
    const auto grid = vals(lq.values(int64_t(t % 3)));
    double best = 1e9;
    for (double g : grid) best = std::min(best, std::abs(g - xv[t]));
    CHECK(std::abs(q[t] - xv[t]) == doctest::Approx(best).epsilon(1e-6));
  }
  // loss = 0.1 mse(out, sg x) + 0.1 mse(sg out, x); with out a straight-through
  // copy of x the two gradients cancel, leaving the identity; the grids get none.
  double mse = 0;
  for (size_t t = 0; t < q.size(); ++t) mse += (q[t] - xv[t]) * (q[t] - xv[t]) / 120.0;
  CHECK(out.term("commitment").item() == doctest::Approx(mse).epsilon(1e-5));
  CHECK(out.loss.item() == doctest::Approx(0.2 * mse).epsilon(1e-5));
  const Tensor w = randn({2, 20, 3}, gen);
  (sum(out.quantized * w) + out.loss).backward();
  CHECK(max_abs_diff(x.grad(), w) < 1e-6);
  CHECK_FALSE(lq.values(0).grad().defined());
  lq.eval();
  CHECK(lq.forward(x, Tensor()).loss.item() == 0.0);
  CHECK(lq.forward(zeros({0, 4, 3}), Tensor()).quantized.shape() == Shape{0, 4, 3});
}

TEST_CASE("LatentQuantize grids start at -1/2 with 0 on them; int levels fill codebook_dim") {
  Generator gen(3);
  LatentQuantizeOptions o;
  o.levels = {5, 4};
  LatentQuantize lq(o, gen);
  CHECK(vals(lq.values(0)) == std::vector<double>{-0.5, -0.25, 0.0, 0.25, 0.5});
  CHECK(vals(lq.values(1)) == std::vector<double>{-0.5, -0.25, 0.0, 0.25});
  LatentQuantizeOptions one;
  one.levels = {3};
  one.codebook_dim = 4;
  LatentQuantize four(one, gen);
  CHECK(four.codebook_size() == 81);
  one.codebook_dim = 0;
  one.levels = {3, 3};
  one.codebook_dim = 3;
  CHECK_THROWS_WITH_AS(LatentQuantize(one, gen), doctest::Contains("codebook_dim 3 does not match"),
                       std::invalid_argument);
}

TEST_CASE("LatentQuantize with projections and image maps") {
  Generator gen(2);
  LatentQuantizeOptions o;
  o.levels = {4, 4};
  o.dim = 6;
  o.num_codebooks = 2;
  LatentQuantize lq(o, gen);
  const QuantizeOutput out = lq.forward(randn({2, 6, 3, 2}, gen), Tensor());
  CHECK(out.quantized.shape() == Shape{2, 6, 3, 2});
  CHECK(out.indices.shape() == Shape{2, 3, 2, 2});
}

TEST_CASE("BinaryMapper: indices, one-hot codes, straight-through gradient (f64)") {
  Generator gen(3);
  BinaryMapperOptions o;
  o.bits = 3;
  BinaryMapper bm(o, gen);
  const Tensor logits =
      from_vector<double>({2.0, -1.0, 0.5, -3.0, 0.2, 1.5}, {2, 3}).requires_grad_();
  BinaryMapperCall call;
  call.deterministic = true;
  const QuantizeOutput out = bm.forward(logits, call);
  // least significant bit first: [1, 0, 1] -> 5, [0, 1, 1] -> 6
  CHECK(out.indices.to_vector<int64_t>() == std::vector<int64_t>{5, 6});
  CHECK(out.quantized.shape() == Shape{2, 8});
  CHECK(vals(out.quantized)[5] == doctest::Approx(1.0));
  CHECK(vals(out.quantized)[8 + 6] == doctest::Approx(1.0));
  // the gradient is that of the factorised code probabilities
  const Tensor w = randn({2, 8}, gen, {.dtype = DType::f64});
  (sum(out.quantized * w) + out.loss).backward();
  auto f = [&] {
    const Tensor l = logits.detach();
    double total = 0;
    const auto lv = vals(l), wv = vals(w);
    for (int r = 0; r < 2; ++r)
      for (int c = 0; c < 8; ++c) {
        double p = 1;
        for (int i = 0; i < 3; ++i) {
          const double s = 1 / (1 + std::exp(-lv[r * 3 + i]));
          p *= (c >> i) & 1 ? s : 1 - s;
        }
        total += p * wv[r * 8 + c];
      }
    // aux loss: mean relu(3 ln 2 - H - ln 2)
    double loss = 0;
    for (int r = 0; r < 2; ++r) {
      double h = 0;
      for (int i = 0; i < 3; ++i) {
        const double s = 1 / (1 + std::exp(-lv[r * 3 + i]));
        h -= s * std::log(s) + (1 - s) * std::log(1 - s);
      }
      loss += std::max(0.0, 3 * std::log(2.0) - h - std::log(2.0));
    }
    return total + loss / 2;
  };
  CHECK(rel_err(logits.grad(), numeric_grad(logits, f)) < 1e-6);
}

TEST_CASE("BinaryMapper samples bits with probability sigmoid(logit / T)") {
  BinaryMapperOptions o;
  o.bits = 2;
  Generator seed_a(9), seed_b(9);
  BinaryMapper bm(o, seed_a);
  BinaryMapperCall call;
  call.temperature = 2.0;
  const Tensor logits = expand(from_vector<float>({1.0f, -2.0f}, {1, 2}), {20000, 2});
  const auto idx = bm.forward(logits, call).indices.to_vector<int64_t>();
  double bit0 = 0, bit1 = 0;
  for (int64_t v : idx) {
    bit0 += v & 1;
    bit1 += (v >> 1) & 1;
  }
  CHECK(bit0 / 20000 == doctest::Approx(1 / (1 + std::exp(-0.5))).epsilon(0.03));
  CHECK(bit1 / 20000 == doctest::Approx(1 / (1 + std::exp(1.0))).epsilon(0.03));
  BinaryMapper again(o, seed_b);
  CHECK(again.forward(logits, call).indices.to_vector<int64_t>() == idx);
  bm.eval();
  CHECK(bm.forward(logits, call).loss.item() == 0.0);
}
