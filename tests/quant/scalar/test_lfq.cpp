// LFQ and ResidualLFQ invariants, and the factorised entropy against a
// brute-force 2^d computation and the direct path (values and gradients, f64).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include "quant/scalar/lfq.h"
#include "quant/scalar/lfq_entropy.h"
#include "quant/scalar/residual_lfq.h"
#include "scalar_test_util.h"
#include "support/gpu.h"

using namespace quanta;
using namespace quanta::quant;
using namespace scalar_test;

namespace {

// Brute force over all 2^d codes, plain loops in f64: per-sample and batch
// clamped entropies of bit logits z [T, d] (one codebook).
std::pair<double, double> brute_force_entropy(const std::vector<double>& z, int64_t T, int64_t d) {
  const int64_t K = int64_t(1) << d;
  std::vector<double> avg(K, 0.0);
  double per_sample = 0;
  for (int64_t t = 0; t < T; ++t) {
    // logits of code c: sum_j (bit_j ? +z_j/2 : -z_j/2), softmax over c
    std::vector<double> logit(K);
    double mx = -1e300;
    for (int64_t c = 0; c < K; ++c) {
      double l = 0;
      for (int64_t j = 0; j < d; ++j) l += ((c >> (d - 1 - j)) & 1 ? 0.5 : -0.5) * z[t * d + j];
      logit[c] = l;
      mx = std::max(mx, l);
    }
    double s = 0;
    for (int64_t c = 0; c < K; ++c) s += std::exp(logit[c] - mx);
    for (int64_t c = 0; c < K; ++c) {
      const double p = std::exp(logit[c] - mx) / s;
      per_sample -= p * std::log(std::max(p, 1e-5));
      avg[c] += p / double(T);
    }
  }
  double batch = 0;
  for (double p : avg) batch -= p * std::log(std::max(p, 1e-5));
  return {per_sample / double(T), batch};
}

// Bit logits with a spread of confidences, including |z| near the clamp's
// boundary (p(flip) ~ 1e-5) and exactly zero.
Tensor spread_logits(int64_t T, int64_t d, Generator& gen, double scale) {
  Tensor z = randn({T, 1, d}, gen, {.dtype = DType::f64}) * scale;
  return z;
}

LFQOptions lfq_opts(int64_t dim, int64_t codebook_size = 0) {
  LFQOptions o;
  o.dim = dim;
  o.codebook_size = codebook_size;
  o.entropy_loss_weight = 0.1;
  o.commitment_loss_weight = 0.25;
  return o;
}

}  // namespace

TEST_CASE("factorised entropy equals brute force over 2^d codes") {
  Generator gen(1);
  for (int64_t d : {1, 2, 5, 8}) {
    for (double scale : {0.3, 3.0, 12.0, 40.0}) {
      const int64_t T = 7;
      const Tensor z = spread_logits(T, d, gen, scale);
      const auto [ps, b] = brute_force_entropy(vals(z), T, d);
      const LFQEntropy h = lfq_entropy_factorised(z, local_token_mean);
      INFO("d = " << d << ", scale = " << scale);
      CHECK(h.per_sample.item() == doctest::Approx(ps).epsilon(1e-10));
      CHECK(h.batch.item() == doctest::Approx(b).epsilon(1e-10));
    }
  }
}

TEST_CASE("the entropy clamp: uniform codes over 2^17 entries") {
  // Every code has p = 2^-17 < 1e-5, so the reference's clamped entropy is
  // -log(1e-5) = 11.51, not 17 ln 2 = 11.78: the walk reproduces the clamp.
  const Tensor z = zeros({3, 1, 17}, {.dtype = DType::f64});
  const LFQEntropy h = lfq_entropy_factorised(z, local_token_mean);
  CHECK(h.per_sample.item() == doctest::Approx(-std::log(1e-5)).epsilon(1e-12));
  CHECK(h.batch.item() == doctest::Approx(-std::log(1e-5)).epsilon(1e-12));
  // ... and at 2^16 every p = 1.5e-5 >= 1e-5: the plain entropy 16 ln 2.
  const LFQEntropy h16 =
      lfq_entropy_factorised(zeros({2, 1, 16}, {.dtype = DType::f64}), local_token_mean);
  CHECK(h16.per_sample.item() == doctest::Approx(16 * std::log(2.0)).epsilon(1e-12));
}

TEST_CASE("factorised and direct paths: equal losses and gradients (f64)") {
  Generator gen(4);
  for (int64_t d : {3, 10, 14}) {
    const int64_t T = 9, C = 2;
    const double m = 1.0, inv_t = 2.5;
    const Tensor x = (randn({T, C, d}, gen, {.dtype = DType::f64}) * 0.8).requires_grad_();
    // All 2^d codes of +-m.
    std::vector<double> book;
    for (int64_t c = 0; c < (int64_t(1) << d); ++c)
      for (int64_t j = 0; j < d; ++j) book.push_back((c >> (d - 1 - j)) & 1 ? m : -m);
    const Tensor codebook = from_vector<double>(book, {int64_t(1) << d, d});
    const LFQEntropy direct = lfq_entropy_direct(x, codebook, inv_t, local_token_mean);
    const LFQEntropy fact = lfq_entropy_factorised(x * (4 * inv_t * m), local_token_mean);
    INFO("d = " << d);
    CHECK(fact.per_sample.item() == doctest::Approx(direct.per_sample.item()).epsilon(1e-9));
    CHECK(fact.batch.item() == doctest::Approx(direct.batch.item()).epsilon(1e-9));
    const Tensor gd_ps = [&] {
      direct.per_sample.backward(Tensor(), true);
      Tensor g = x.grad().clone();
      x.zero_grad();
      return g;
    }();
    fact.per_sample.backward(Tensor(), true);
    CHECK(rel_err(x.grad(), gd_ps) < 1e-8);
    x.zero_grad();
    direct.batch.backward();
    const Tensor gd_b = x.grad().clone();
    x.zero_grad();
    fact.batch.backward();
    CHECK(rel_err(x.grad(), gd_b) < 1e-8);
    x.zero_grad();
  }
}

TEST_CASE("entropy gradients match central differences (f64)") {
  Generator gen(8);
  const int64_t T = 5, d = 6;
  // Confidences from near-uniform to the clamp region.
  const Tensor z = (randn({T, 1, d}, gen, {.dtype = DType::f64}) * 6.0).requires_grad_();
  const LFQEntropy h = lfq_entropy_factorised(z, local_token_mean);
  (h.per_sample + 0.7 * h.batch).backward();
  auto f = [&] {
    const LFQEntropy e = lfq_entropy_factorised(z.detach(), local_token_mean);
    return e.per_sample.item() + 0.7 * e.batch.item();
  };
  CHECK(rel_err(z.grad(), numeric_grad(z, f)) < 1e-6);
}

TEST_CASE("bit probabilities: the engine's sigmoids of -z and z, in halves, with their gradient") {
  Generator gen(12);
  for (const Device dev : quanta::testing::cpu_and_test_devices())
    for (const DType dt : {DType::f32, DType::f64}) {
      INFO(dev.str() << " " << std::string(dtype_name(dt)));
      // Logits from the tails (|z| 30: P(0) near 1e-13) to 0.
      const Tensor z = (randn({7, 5}, gen, {.dtype = dt}) * 12.0).to(dev);
      for (const int64_t high : {int64_t{0}, int64_t{2}, int64_t{5}}) {
        const std::vector<Tensor> pi = bit_probability_halves(z, high);
        REQUIRE(pi.size() == 2);
        CHECK(pi[0].shape() == Shape{7, high, 2});
        CHECK(pi[1].shape() == Shape{7, 5 - high, 2});
        // The composed ops' values, within an ulp or two of each (the CPU's
        // sigmoid op runs Eigen's vector exp, the kernel the scalar form).
        const Tensor want = stack({sigmoid(-z), sigmoid(z)}, -1).to(Device::cpu());
        const double eps = dt == DType::f32 ? 1.2e-7 : 2.3e-16;
        for (const auto& [got, part] : {std::pair{pi[0], slice(want, 1, 0, high)},
                                        std::pair{pi[1], slice(want, 1, high, 5)}}) {
          const std::vector<double> g = vals(got.to(Device::cpu())), w = vals(part);
          REQUIRE(g.size() == w.size());
          double worst = 0;  // in units of the value's own precision
          for (size_t i = 0; i < g.size(); ++i)
            worst = std::max(worst, std::abs(g[i] - w[i]) / (eps * std::abs(w[i]) + 1e-300));
          CHECK(worst <= 4.0);
        }
      }
    }
  // f64 central differences of a weighted sum of both halves' probabilities.
  const Tensor z0 = randn({4, 6}, gen, {.dtype = DType::f64}) * 3.0;
  const Tensor w = randn({4, 6, 2}, gen, {.dtype = DType::f64});
  auto loss = [&](const Tensor& zt) {
    const std::vector<Tensor> pi = bit_probability_halves(zt, 2);
    return sum(pi[0] * slice(w, 1, 0, 2)) + sum(pi[1] * slice(w, 1, 2, 6));
  };
  Tensor z = z0.clone();
  z.requires_grad_(true);
  loss(z).backward();
  CHECK(max_abs_diff(numeric_grad([&](const Tensor& zt) { return loss(zt).item(); }, z0),
                     z.grad()) < 1e-8);
  CHECK_THROWS_WITH_AS(bit_probability_halves(zeros({3}), 0),
                       "[LFQ] bit logits must be [rows, bits], got [3]", std::invalid_argument);
  CHECK_THROWS_WITH_AS(bit_probability_halves(zeros({3, 4}), 5), "[LFQ] a split after bit 5 of 4",
                       std::invalid_argument);
}

TEST_CASE("LFQ codes are +-codebook_scale and round-trip through indices") {
  Generator gen(12);
  for (bool spherical : {false, true}) {
    LFQOptions o = lfq_opts(6);
    o.codebook_scale = 0.5;
    o.spherical = spherical;
    LFQ lfq(o, gen);
    lfq.eval();
    const Tensor x = randn({2, 30, 6}, gen);
    const QuantizeOutput out = lfq.forward(x, Tensor());
    CHECK(out.indices.dtype() == DType::i64);
    const double m = spherical ? 0.5 / std::sqrt(6.0) : 0.5;
    for (double v : vals(out.quantized)) CHECK(std::abs(std::abs(v) - m) < 1e-7);
    CHECK(max_abs_diff(lfq.indices_to_codes(out.indices), out.quantized) < 1e-7);
    // index bits: first dim most significant, positive -> 1
    const auto xv = vals(x);
    const auto iv = out.indices.to_vector<int64_t>();
    for (int64_t t = 0; t < 60; ++t) {
      int64_t expect = 0;
      for (int64_t j = 0; j < 6; ++j) expect = expect * 2 + (xv[t * 6 + j] > 0 ? 1 : 0);
      CHECK(iv[t] == expect);
    }
    CHECK(out.loss.item() == 0.0);  // no losses in eval
  }
  LFQ small(lfq_opts(1), gen);
  small.eval();
  CHECK(small.forward(from_vector<float>({0.3f}, {1, 1, 1}), Tensor()).indices.item() == 1);
}

TEST_CASE("LFQ straight-through gradient is the identity") {
  Generator gen(3);
  LFQOptions o = lfq_opts(5);
  o.entropy_loss_weight = 0;
  o.commitment_loss_weight = 0;
  LFQ lfq(o, gen);
  const Tensor x = randn({2, 4, 5}, gen).requires_grad_();
  const Tensor w = randn({2, 4, 5}, gen);
  sum(lfq.forward(x, Tensor()).quantized * w).backward();
  CHECK(max_abs_diff(x.grad(), w) == 0.0);
}

TEST_CASE("LFQ loss gradients with projections match central differences (f64)") {
  Generator gen(30);
  for (bool spherical : {false, true}) {
    LFQOptions o = lfq_opts(7, 16);
    o.spherical = spherical;
    o.soft_clamp_input_value = 2.0;
    o.inv_temperature = 3.0;  // soft distributions: every term matters
    LFQ lfq(o, gen);
    lfq.to(DType::f64);
    const Tensor x = randn({2, 6, 7}, gen, {.dtype = DType::f64}).requires_grad_();
    auto loss_of = [&](const Tensor& in) { return lfq.forward(in, Tensor()).loss; };
    loss_of(x).backward();
    auto f = [&] { return loss_of(x.detach()).item(); };
    INFO("spherical = " << spherical);
    CHECK(rel_err(x.grad(), numeric_grad(x, f)) < 1e-5);
    const Tensor W = lfq.find("project_in.weight");
    CHECK(rel_err(W.grad(), numeric_grad(W, f)) < 1e-5);
  }
}

TEST_CASE("LFQ: direct and factorised layers agree, with masks and token sampling") {
  Generator gen(40);
  for (double frac : {1.0, 0.5}) {
    LFQOptions o = lfq_opts(12, 1024);
    o.frac_per_sample_entropy = frac;
    o.inv_temperature = 10;
    // The same seed: both layers sample the same tokens.
    Generator seed_a(5), seed_b(5);
    LFQ fast(o, seed_a);
    o.entropy_path = LFQEntropyPath::direct;
    LFQ direct(o, seed_b);
    direct.load_state_dict(fast.state_dict());
    const Tensor x = randn({3, 8, 12}, gen);
    const Tensor mask = gt(rand({3, 8}, gen), scalar(0.3));
    const Tensor xa = x.clone().requires_grad_(), xb = x.clone().requires_grad_();
    const QuantizeOutput a = fast.forward(xa, mask);
    const QuantizeOutput b = direct.forward(xb, mask);
    INFO("frac = " << frac);
    for (const char* t : {"per_sample_entropy", "batch_entropy", "commitment"})
      CHECK(a.term(t).item() == doctest::Approx(b.term(t).item()).epsilon(2e-5));
    a.loss.backward();
    b.loss.backward();
    CHECK(rel_err(xa.grad(), xb.grad()) < 1e-4);
    CHECK(rel_err(fast.find("project_in.weight").grad(), direct.find("project_in.weight").grad()) <
          1e-4);
  }
}

TEST_CASE("LFQ masks: masked tokens contribute nothing; all masked gives zero loss") {
  Generator gen(50);
  LFQOptions o = lfq_opts(6);
  o.inv_temperature = 5;
  LFQ lfq(o, gen);
  const Tensor x = randn({1, 10, 6}, gen);
  std::vector<uint8_t> keep(10, 1);
  for (int i = 6; i < 10; ++i) keep[i] = 0;
  const Tensor mask = from_vector<uint8_t>(keep, {1, 10}).to(DType::boolean);
  const QuantizeOutput masked = lfq.forward(x, mask);
  const QuantizeOutput truncated = lfq.forward(slice(x, 1, 0, 6), Tensor());
  CHECK(masked.loss.item() == doctest::Approx(truncated.loss.item()).epsilon(1e-6));
  for (const char* t : {"per_sample_entropy", "batch_entropy", "commitment"})
    CHECK(masked.term(t).item() == doctest::Approx(truncated.term(t).item()).epsilon(1e-6));

  const Tensor none = zeros({1, 10}, {.dtype = DType::boolean});
  const Tensor xg = x.clone().requires_grad_();
  const QuantizeOutput empty = lfq.forward(xg, none);
  CHECK(empty.loss.item() == 0.0);
  for (const auto& [name, t] : empty.losses) CHECK(t.item() == 0.0);
  (empty.loss + sum(empty.quantized)).backward();
  for (double g : vals(xg.grad())) CHECK(std::isfinite(g));

  for (const Shape& s : {Shape{0, 3, 6}, Shape{2, 0, 6}}) {
    const QuantizeOutput z = lfq.forward(zeros(s), Tensor());
    CHECK(z.quantized.shape() == s);
    CHECK(z.loss.item() == 0.0);
  }
  LFQOptions direct = o;
  direct.entropy_path = LFQEntropyPath::direct;
  LFQ d(direct, gen);
  CHECK(d.forward(zeros({0, 3, 6}), Tensor()).loss.item() == 0.0);
  CHECK(d.forward(x, none).loss.item() == 0.0);
}

TEST_CASE("LFQ's token means go through one replaceable function") {
  Generator gen(60);
  LFQOptions o = lfq_opts(8);
  o.inv_temperature = 4;
  o.commitment_loss_weight = 0.25;
  LFQ lfq(o, gen);
  const Tensor x = randn({2, 5, 8}, gen);
  const QuantizeOutput base = lfq.forward(x, Tensor());
  std::vector<int64_t> counts;
  std::vector<Shape> shapes;
  // E.g. a cross-rank mean: here, the same mean computed differently.
  lfq.token_mean = [&](const Tensor& s, int64_t count) {
    counts.push_back(count);
    shapes.push_back(s.shape());
    return s * (1.0 / double(count));
  };
  const QuantizeOutput replaced = lfq.forward(x, Tensor());
  // Per-sample entropy, the batch distribution and the commitment: every
  // token mean of the loss, each over the 10 tokens.
  REQUIRE(counts.size() == 3);
  for (int64_t c : counts) CHECK(c == 10);
  CHECK(std::count(shapes.begin(), shapes.end(), Shape{1, 256}) == 1);
  for (const char* term : {"per_sample_entropy", "batch_entropy", "commitment"}) {
    CAPTURE(term);
    CHECK(replaced.term(term).item() == doctest::Approx(base.term(term).item()).epsilon(1e-6));
  }
}

TEST_CASE("ResidualLFQ: per-layer scales, losses and quantize dropout") {
  Generator gen(70);
  ResidualLFQOptions o;
  o.lfq = lfq_opts(10, 256);
  o.num_quantizers = 3;
  ResidualLFQ r(o, gen);
  const Tensor x = randn({2, 5, 10}, gen);
  const QuantizeOutput out = r.forward(x, Tensor());
  CHECK(out.indices.shape() == Shape{2, 5, 3});
  CHECK(out.loss.shape() == Shape{3});
  const Tensor books = r.codebooks();
  CHECK(books.shape() == Shape{3, 256, 8});
  CHECK(max_abs(select(books, 0, 2)) == doctest::Approx(0.25));
  r.eval();
  const QuantizeOutput ev = r.forward(x, Tensor());
  CHECK(max_abs_diff(r.get_output_from_indices(ev.indices), ev.quantized) < 1e-5);
  CHECK(vals(ev.loss) == std::vector<double>{0, 0, 0});

  ResidualLFQOptions d = o;
  d.quantize_dropout = true;
  ResidualLFQ drop(d, gen);
  bool dropped_some = false;
  for (int i = 0; i < 20; ++i) {
    const QuantizeOutput q = drop.forward(x, Tensor());
    const auto idx = q.indices.to_vector<int64_t>();
    const auto loss = vals(q.loss);
    for (int64_t l = 1; l < 3; ++l)
      if (idx[l] == -1) {
        dropped_some = true;
        CHECK(loss[l] == 0.0);
      }
  }
  CHECK(dropped_some);

  GroupedResidualLFQOptions g;
  g.rlfq = o;
  g.rlfq.lfq.dim = 16;
  g.groups = 2;
  GroupedResidualLFQ grouped(g, gen);
  const QuantizeOutput go = grouped.forward(randn({2, 5, 16}, gen), Tensor());
  CHECK(go.indices.shape() == Shape{2, 2, 5, 3});
  CHECK(go.loss.shape() == Shape{2, 3});
}

TEST_CASE("LFQ and ResidualLFQ on image feature maps") {
  Generator gen(80);
  LFQOptions o = lfq_opts(8);
  o.num_codebooks = 2;
  o.codebook_size = 16;
  LFQ lfq(o, gen);
  const Tensor img = randn({2, 8, 3, 5}, gen);
  const QuantizeOutput out = lfq.forward(img, Tensor());
  CHECK(out.quantized.shape() == Shape{2, 8, 3, 5});
  CHECK(out.indices.shape() == Shape{2, 3, 5, 2});
  CHECK(max_abs_diff(lfq.indices_to_codes(out.indices), out.quantized) < 1e-7);
  // the same tokens channel-last give the same indices and losses
  const Tensor seq = reshape(permute(img, {0, 2, 3, 1}), {2, 15, 8});
  const QuantizeOutput s = lfq.forward(seq, Tensor());
  CHECK(vals(s.indices) == vals(out.indices));
  CHECK(s.loss.item() == doctest::Approx(out.loss.item()).epsilon(1e-6));

  ResidualLFQOptions r;
  r.lfq = lfq_opts(6, 16);
  r.num_quantizers = 2;
  ResidualLFQ rl(r, gen);
  const QuantizeOutput ro = rl.forward(randn({2, 6, 4, 4}, gen), Tensor());
  CHECK(ro.quantized.shape() == Shape{2, 6, 4, 4});
  CHECK(ro.indices.shape() == Shape{2, 4, 4, 2});
}

TEST_CASE("LFQ projection_has_bias = false: no bias parameters, y = sign(x W_in^T) W_out^T") {
  Generator gen(6);
  LFQOptions o = lfq_opts(6, 16);  // 4 bits from 6 features: projections
  auto names = [](const LFQ& l) {
    std::set<std::string> n;
    for (const auto& [name, t] : l.state_dict()) n.insert(name);
    return n;
  };
  CHECK(names(LFQ(o, gen)) == std::set<std::string>{"project_in.weight", "project_in.bias",
                                                    "project_out.weight", "project_out.bias",
                                                    "mask"});
  o.projection_has_bias = false;
  LFQ lfq(o, gen);
  CHECK(names(lfq) == std::set<std::string>{"project_in.weight", "project_out.weight", "mask"});
  lfq.eval();
  const Tensor x = randn({2, 5, 6}, gen);
  const QuantizeOutput out = lfq.forward(x, Tensor());
  const auto xv = vals(x), Win = vals(lfq.find("project_in.weight")),
             Wout = vals(lfq.find("project_out.weight"));
  const auto iv = out.indices.to_vector<int64_t>();
  std::vector<double> expect;
  for (int64_t t = 0; t < 10; ++t) {
    std::vector<double> q(4);
    int64_t index = 0;
    for (int64_t j = 0; j < 4; ++j) {
      double z = 0;  // no bias
      for (int64_t i = 0; i < 6; ++i) z += Win[j * 6 + i] * xv[t * 6 + i];
      q[j] = z > 0 ? 1.0 : -1.0;
      index = index * 2 + (z > 0 ? 1 : 0);
    }
    CHECK(iv[t] == index);
    for (int64_t e = 0; e < 6; ++e) {
      double y = 0;
      for (int64_t j = 0; j < 4; ++j) y += Wout[e * 4 + j] * q[j];
      expect.push_back(y);
    }
  }
  CHECK(max_abs_diff(out.quantized, from_vector<double>(expect, {2, 5, 6})) < 1e-6);
  // The lookup takes the same bias-free route.
  CHECK(max_abs_diff(lfq.indices_to_codes(out.indices), out.quantized) < 1e-6);
}

TEST_CASE("LFQ keep_num_codebooks_dim: index shapes") {
  Generator gen(7);
  const Tensor x = randn({2, 7, 4}, gen);
  LFQ plain(lfq_opts(4), gen);
  const QuantizeOutput a = plain.forward(x, Tensor());
  CHECK(a.indices.shape() == Shape{2, 7});
  LFQOptions o = lfq_opts(4);
  o.keep_num_codebooks_dim = true;
  LFQ keep(o, gen);
  const QuantizeOutput b = keep.forward(x, Tensor());
  CHECK(b.indices.shape() == Shape{2, 7, 1});
  CHECK(vals(b.indices) == vals(a.indices));
  CHECK(max_abs_diff(keep.indices_to_codes(b.indices), b.quantized) == 0.0);
  CHECK(keep.forward(randn({2, 4, 3, 5}, gen), Tensor()).indices.shape() == Shape{2, 3, 5, 1});
  // Two codebooks of 4 bits from 8 features: [B, N, 2] by default, each the
  // bits of its own half (first dim most significant).
  o = lfq_opts(8, 16);
  o.num_codebooks = 2;
  LFQ two(o, gen);
  CHECK_FALSE(two.has_projections());
  const Tensor x8 = randn({2, 7, 8}, gen);
  const QuantizeOutput c = two.forward(x8, Tensor());
  CHECK(c.indices.shape() == Shape{2, 7, 2});
  const auto xv = vals(x8);
  const auto iv = c.indices.to_vector<int64_t>();
  for (int64_t t = 0; t < 14; ++t)
    for (int64_t cb = 0; cb < 2; ++cb) {
      int64_t expect = 0;
      for (int64_t j = 0; j < 4; ++j) expect = expect * 2 + (xv[t * 8 + cb * 4 + j] > 0 ? 1 : 0);
      CHECK(iv[t * 2 + cb] == expect);
    }
  o.keep_num_codebooks_dim = false;
  CHECK_THROWS_WITH_AS(LFQ(o, gen), doctest::Contains("keep_num_codebooks_dim"),
                       std::invalid_argument);
}
