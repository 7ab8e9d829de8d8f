// SimVQ, ResidualSimVQ and RandomProjectionQuantizer.
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <set>

#include "quant/vq/random_projection_quantizer.h"
#include "quant/vq/sim_vq.h"
#include "quanta.h"
#include "vq_test_util.h"

using namespace quanta;
using namespace quanta::quant;
using quanta::testing::max_abs_diff;

TEST_CASE("SimVQ: nearest transformed codes, commitment loss, gradient to the transform") {
  Generator gen(1), data(2);
  SimVQOptions o;
  o.dim = 5;
  o.codebook_size = 11;
  o.frozen_codebook_dim = 3;
  SimVQ vq(o, gen);
  CHECK(vq.state_dict().size() == 2);  // code_transform.weight, frozen_codebook
  Tensor x = randn({2, 6, 5}, data);
  x.requires_grad_(true);
  QuantizeOutput out = vq.forward(x);
  const Tensor codes = vq.codebook().detach();
  // Brute-force nearest codes.
  const auto idx = out.indices.to_vector<int64_t>();
  const auto xv = x.to_vector<double>(), cv = codes.to_vector<double>();
  for (int64_t t = 0; t < 12; ++t) {
    int64_t best = 0;
    double bd = 1e300;
    for (int64_t k = 0; k < 11; ++k) {
      double d = 0;
      for (int e = 0; e < 5; ++e) d += std::pow(xv[t * 5 + e] - cv[k * 5 + e], 2);
      if (d < bd) bd = d, best = k;
    }
    CHECK(idx[t] == best);
  }
  const Tensor q = reshape(index_select(codes, 0, reshape(out.indices, {12})), {2, 6, 5});
  CHECK(max_abs_diff(out.quantized, q) < 1e-6);
  const double mse = mean(square(q - x.detach())).item();
  CHECK(out.loss.item() == doctest::Approx(1.25 * mse).epsilon(1e-5));
  CHECK(max_abs_diff(vq.indices_to_codes(out.indices), q) < 1e-6);
  (sum(out.quantized) + out.loss).backward();
  const Tensor wg = vq.find("code_transform.weight").grad();
  REQUIRE(wg.defined());
  CHECK(sum(abs(wg)).item() > 0.0);
  CHECK(x.grad().defined());
  // Masked tokens: zero output, index -1.
  const Tensor mask =
      to_dtype(from_vector<uint8_t>({1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1}, {2, 6}), DType::boolean);
  QuantizeOutput m = vq.forward(x.detach(), mask);
  CHECK(m.indices.to_vector<int64_t>()[1] == -1);
  CHECK(sum(abs(select(select(m.quantized, 0, 0), 0, 1))).item() == 0.0);
}

TEST_CASE("ResidualSimVQ: residual stack, dropout and lookups") {
  Generator gen(3), data(4);
  ResidualSimVQOptions o;
  o.dim = 4;
  o.num_quantizers = 3;
  o.codebook_size = 7;
  ResidualSimVQ rvq(o, gen);
  const Tensor x = randn({2, 5, 4}, data);
  QuantizeOutput out = rvq.forward(x);
  CHECK(out.indices.shape() == Shape{2, 5, 3});
  CHECK(out.loss.shape() == Shape{3});
  CHECK(max_abs_diff(rvq.get_output_from_indices(out.indices), out.quantized) < 1e-5);
  o.quantize_dropout = true;
  ResidualSimVQ dropping(o, gen);
  bool dropped = false;
  for (int i = 0; i < 10; ++i) {
    QuantizeOutput d = dropping.forward(x);
    for (int64_t v : d.indices.to_vector<int64_t>()) dropped = dropped || v == -1;
  }
  CHECK(dropped);
  CHECK(rvq.forward(zeros({0, 5, 4})).indices.shape() == Shape{0, 5, 3});
}

TEST_CASE("RandomProjectionQuantizer: frozen, deterministic targets and a CE loss") {
  Generator gen(5), data(6);
  RandomProjectionQuantizerOptions o;
  o.dim = 10;
  o.codebook_size = 16;
  o.codebook_dim = 4;
  o.num_codebooks = 2;
  RandomProjectionQuantizer rpq(o, gen);
  const Tensor x = randn({2, 9, 10}, data);
  const Tensor before = rpq.vq().codebook().embed().clone();
  QuantizeOutput a = rpq.forward(x);
  QuantizeOutput b = rpq.forward(x);
  CHECK(a.indices.shape() == Shape{2, 9, 2});
  CHECK(max_abs_diff(a.indices, b.indices) == 0.0);
  CHECK(max_abs_diff(rpq.vq().codebook().embed(), before) == 0.0);
  const double own = rpq.forward(x, a.indices).loss.item();
  const double other = rpq.forward(x, randint(0, 16, {2, 9, 2}, data)).loss.item();
  CHECK(std::isfinite(own));
  CHECK(own < other);
}

TEST_CASE("ResidualSimVQ quantize dropout respects cutoff_index and multiple_of") {
  // Q = 7, k uniform in [2, 6], rounded up so that k + 1 is a multiple of 3
  // (a k past the last layer keeps them all): 3 layers kept w.p. 1/5,
  // 6 w.p. 3/5, 7 w.p. 1/5.
  Generator gen(7), data(8);
  ResidualSimVQOptions o;
  o.dim = 3;
  o.num_quantizers = 7;
  o.codebook_size = 5;
  o.quantize_dropout = true;
  o.quantize_dropout_cutoff_index = 2;
  o.quantize_dropout_multiple_of = 3;
  ResidualSimVQ rvq(o, gen);
  const Tensor x = randn({2, 3, 3}, data);
  std::map<int64_t, int> kept_count;
  const int draws = 300;
  for (int i = 0; i < draws; ++i) {
    const QuantizeOutput out = rvq.forward(x);
    const auto idx = out.indices.to_vector<int64_t>();
    const auto loss = out.loss.to_vector<double>();
    int64_t kept = 0;
    while (kept < 7 && idx[kept] != -1) ++kept;
    ++kept_count[kept];
    for (int64_t t = 0; t < 6; ++t)  // one draw per forward: every token alike
      for (int64_t q = 0; q < 7; ++q) CHECK((idx[t * 7 + q] == -1) == (q >= kept));
    for (int64_t q = kept; q < 7; ++q) CHECK(loss[q] == 0.0);
  }
  CHECK(kept_count.size() == 3);
  CHECK(kept_count.count(3) == 1);
  CHECK(kept_count.count(6) == 1);
  CHECK(kept_count.count(7) == 1);
  // Binomial(300, 1/5): mean 60, sd 7; Binomial(300, 3/5): mean 180, sd 8.5.
  CHECK(std::abs(kept_count[3] - 60) < 35);
  CHECK(std::abs(kept_count[6] - 180) < 45);
  CHECK(std::abs(kept_count[7] - 60) < 35);

  // multiple_of 1: every count from cutoff + 1 to Q, never fewer.
  o.quantize_dropout_cutoff_index = 4;
  o.quantize_dropout_multiple_of = 1;
  ResidualSimVQ plain(o, gen);
  std::set<int64_t> seen;
  for (int i = 0; i < 60; ++i) {
    const auto idx = plain.forward(x).indices.to_vector<int64_t>();
    int64_t kept = 0;
    while (kept < 7 && idx[kept] != -1) ++kept;
    seen.insert(kept);
  }
  CHECK(seen == std::set<int64_t>{5, 6, 7});
}
