// Top-k codes and ResidualVQ's beam search: the k nearest codes against a
// brute-force sort, the beam's best path against an exhaustive search when
// the beam holds every path, the codebooks' statistics from the chosen path,
// and the refusals. quanta parity checks the numbers against
// vector-quantize-pytorch 1.32 (vq_topk3_*, rvq_q3_beam*, rvq_q3_eval_beam4_proj).
#include <doctest/doctest.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

#include "quant/vq/residual_vq.h"
#include "quant/vq/top_codes.h"
#include "quant/vq/vector_quantize.h"
#include "quanta.h"
#include "support/gpu.h"
#include "vq_test_util.h"

using namespace quanta;
using namespace quanta::quant;
using quanta::testing::max_abs_diff;

namespace {

// Squared distance of row t of x [T, d] to code c of e [K, d], in f64.
double sq(const std::vector<double>& x, int64_t t, const std::vector<double>& e, int64_t c,
          int64_t d) {
  double s = 0;
  for (int64_t i = 0; i < d; ++i)
    s += (x[size_t(t * d + i)] - e[size_t(c * d + i)]) *
         (x[size_t(t * d + i)] - e[size_t(c * d + i)]);
  return s;
}

}  // namespace

TEST_CASE("top_indices: the k largest, largest first, ties to the lower index") {
  const Tensor x = from_vector<float>({1, 5, 3, 5, -2, 0, 0, 7, 7, 1}, {2, 5});
  CHECK(top_indices(x, 3).to_vector<int64_t>() == std::vector<int64_t>{1, 3, 2, 2, 3, 4});
  CHECK(top_indices(x, 1).shape() == Shape{2, 1});
  CHECK(top_indices(x, 2, /*largest=*/false).to_vector<int64_t>() ==
        std::vector<int64_t>{4, 0, 0, 1});
  CHECK_THROWS_WITH_AS(top_indices(x, 6), doctest::Contains("k must be in [1, 5]"),
                       std::invalid_argument);
}

TEST_CASE("forward_topk: the k nearest codes, per-token losses, no update") {
  Generator gen(1), data(2);
  VectorQuantizeOptions o;
  o.dim = 4;
  o.codebook_size = 7;
  o.commitment_weight = 0.5;
  VectorQuantize vq(o, gen);
  const Tensor x = randn({2, 3, 4}, data);
  const Tensor mask = to_dtype(from_vector<uint8_t>({1, 1, 0, 1, 1, 1}, {2, 3}), DType::boolean);
  const auto xv = x.to_vector<double>();
  const Tensor before = vq.codebook().embed().clone();
  const auto ev = before.to_vector<double>();
  for (bool training : {true, false}) {
    CAPTURE(training);
    vq.train(training);
    const QuantizeOutput out = vq.forward_topk(x, 3, mask);
    REQUIRE(out.quantized.shape() == Shape{2, 3, 3, 4});
    REQUIRE(out.indices.shape() == Shape{2, 3, 3});
    REQUIRE(out.loss.shape() == Shape{2, 3, 3});
    const auto idx = out.indices.to_vector<int64_t>();
    const auto q = out.quantized.detach().to_vector<double>();
    const auto loss = out.loss.detach().to_vector<double>();
    const auto commit = out.term("commitment").detach().to_vector<double>();
    for (int64_t t = 0; t < 6; ++t) {
      if (t == 2) {  // masked
        for (int64_t j = 0; j < 3; ++j) CHECK(idx[size_t(t * 3 + j)] == -1);
        for (int64_t j = 0; j < 12; ++j) CHECK(q[size_t(t * 12 + j)] == 0.0);
        continue;
      }
      std::vector<int64_t> order(7);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return sq(xv, t, ev, a, 4) < sq(xv, t, ev, b, 4);
      });
      for (int64_t j = 0; j < 3; ++j) {
        const int64_t c = idx[size_t(t * 3 + j)];
        CHECK(c == order[size_t(j)]);
        for (int64_t i = 0; i < 4; ++i)
          CHECK(q[size_t((t * 3 + j) * 4 + i)] ==
                doctest::Approx(ev[size_t(c * 4 + i)]).epsilon(1e-6));
        CHECK(commit[size_t(t * 3 + j)] == doctest::Approx(sq(xv, t, ev, c, 4) / 4).epsilon(1e-5));
        CHECK(loss[size_t(t * 3 + j)] ==
              doctest::Approx(0.5 * commit[size_t(t * 3 + j)]).epsilon(1e-6));
      }
    }
    CHECK(max_abs_diff(vq.codebook().embed(), before) == 0.0);  // candidates only
  }
  // k is capped at the codebook size; one vector per row gives [B, k, D].
  vq.eval();
  CHECK(vq.forward_topk(x, 50).indices.shape() == Shape{2, 3, 7});
  CHECK(vq.forward_topk(select(x, 1, 0), 2).quantized.shape() == Shape{2, 2, 4});
}

TEST_CASE("forward_topk with a cosine codebook: the most similar codes first") {
  Generator gen(21), data(22);
  VectorQuantizeOptions o;
  o.dim = 4;
  o.codebook_size = 9;
  o.use_cosine_sim = true;
  VectorQuantize vq(o, gen);
  vq.eval();
  const Tensor x = randn({1, 6, 4}, data);
  const auto idx = vq.forward_topk(x, 4).indices.to_vector<int64_t>();
  const auto e = vq.codebook().embed().to_vector<double>(), xv = x.to_vector<double>();
  for (int64_t t = 0; t < 6; ++t) {
    std::vector<double> sim(9);
    for (int64_t c = 0; c < 9; ++c)
      for (int64_t i = 0; i < 4; ++i)
        sim[size_t(c)] += xv[size_t(t * 4 + i)] * e[size_t(c * 4 + i)];
    for (int64_t j = 0; j + 1 < 4; ++j)
      CHECK(sim[size_t(idx[size_t(t * 4 + j)])] >= sim[size_t(idx[size_t(t * 4 + j + 1)])]);
    CHECK(*std::max_element(sim.begin(), sim.end()) == sim[size_t(idx[size_t(t * 4)])]);
  }
}

TEST_CASE("forward_topk: refusals name what is wrong") {
  Generator gen(3), data(4);
  VectorQuantizeOptions o;
  o.dim = 4;
  o.codebook_size = 5;
  const Tensor x = randn({1, 3, 4}, data);
  VectorQuantizeOptions heads = o;
  heads.heads = 2;
  heads.codebook_dim = 2;
  VectorQuantize two(heads, gen);
  CHECK_THROWS_WITH_AS(two.forward_topk(x, 2), doctest::Contains("heads = 1"),
                       std::invalid_argument);
  VectorQuantizeOptions ce = o;
  ce.commitment_use_cross_entropy_loss = true;
  VectorQuantize cross(ce, gen);
  CHECK_THROWS_WITH_AS(cross.forward_topk(x, 2),
                       doctest::Contains("commitment_use_cross_entropy_loss"),
                       std::invalid_argument);
  VectorQuantize plain(o, gen);
  CHECK_THROWS_WITH_AS(plain.forward_topk(x, 0), doctest::Contains("topk must be >= 1"),
                       std::invalid_argument);
  VectorQuantizeOptions first = o;
  first.channel_last = false;
  VectorQuantize channel_first(first, gen);
  CHECK_THROWS_WITH_AS(channel_first.forward_topk(randn({1, 4, 3}, data), 2),
                       doctest::Contains("channel-last"), std::invalid_argument);
}

TEST_CASE("beam search holding every path finds the best one (exhaustive search)") {
  // Q = 2 layers of K = 4 codes, beam 4: layer 0 keeps all 4 codes, layer 1
  // weighs all 16 paths, so the result is the minimum of the weighted score.
  Generator gen(5), data(6);
  ResidualVQOptions o;
  o.dim = 3;
  o.num_quantizers = 2;
  o.codebook_sizes = {4};
  o.beam_size = 4;
  o.beam_score_quantizer_weights = {1.0, 0.5};
  ResidualVQ rvq(o, gen);
  rvq.eval();
  const Tensor x = randn({2, 5, 3}, data);
  const QuantizeOutput out = rvq.forward(x);
  const auto xv = x.to_vector<double>();
  const auto e0 = rvq.layer(0).codebook().embed().to_vector<double>();
  const auto e1 = rvq.layer(1).codebook().embed().to_vector<double>();
  const auto idx = out.indices.to_vector<int64_t>();
  for (int64_t t = 0; t < 10; ++t) {
    double best = std::numeric_limits<double>::infinity();
    int64_t best0 = -1, best1 = -1;
    for (int64_t a = 0; a < 4; ++a)
      for (int64_t b = 0; b < 4; ++b) {
        std::vector<double> r(3);
        for (int64_t i = 0; i < 3; ++i)
          r[size_t(i)] = xv[size_t(t * 3 + i)] - e0[size_t(a * 3 + i)];
        const double score = sq(xv, t, e0, a, 3) / 3 + 0.5 * sq(r, 0, e1, b, 3) / 3;
        if (score < best) best = score, best0 = a, best1 = b;
      }
    CHECK(idx[size_t(t * 2)] == best0);
    CHECK(idx[size_t(t * 2 + 1)] == best1);
  }
  // The output is the path's summed codes.
  CHECK(max_abs_diff(out.quantized, rvq.get_output_from_indices(out.indices)) < 1e-6);
}

TEST_CASE("beam search in training: every layer takes the statistics of the chosen path") {
  Generator g1(7), g2(7), data(8);
  ResidualVQOptions o;
  o.dim = 4;
  o.num_quantizers = 3;
  o.codebook_sizes = {6};
  o.beam_size = 3;
  ResidualVQ searched(o, g1), by_hand(o, g2);
  const Tensor x = randn({2, 4, 4}, data);
  const Tensor mask =
      to_dtype(from_vector<uint8_t>({1, 1, 1, 0, 1, 1, 0, 0}, {2, 4}), DType::boolean);
  const QuantizeOutput out = searched.forward(x, mask);
  // The same statistics applied by hand along the returned path.
  Tensor residual = x;
  for (int64_t i = 0; i < 3; ++i) {
    const Tensor idx = select(out.indices, -1, i);
    const Tensor codes = by_hand.layer(i).get_codes_from_indices(idx);
    by_hand.layer(i).update_indices(residual, idx, mask);
    residual = residual - codes;
  }
  for (int64_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(max_abs_diff(searched.layer(i).codebook().cluster_size(),
                       by_hand.layer(i).codebook().cluster_size()) < 1e-6);
    CHECK(max_abs_diff(searched.layer(i).codebook().embed(), by_hand.layer(i).codebook().embed()) <
          1e-6);
  }
  // Losses: each layer's per-token commitment averaged over the 5 valid tokens.
  CHECK(out.loss.shape() == Shape{3});
}

TEST_CASE("beam size 1 is the greedy stack; eval_beam_size applies in eval; refusals") {
  Generator g1(9), g2(9), data(10);
  ResidualVQOptions o;
  o.dim = 4;
  o.num_quantizers = 3;
  o.codebook_sizes = {6};
  ResidualVQ greedy(o, g1);
  o.beam_size = 1;
  o.eval_beam_size = 4;
  ResidualVQ beam(o, g2);
  const Tensor x = randn({2, 4, 4}, data);
  const QuantizeOutput a = greedy.forward(x), b = beam.forward(x);
  CHECK(a.indices.to_vector<int64_t>() == b.indices.to_vector<int64_t>());
  CHECK(max_abs_diff(a.quantized, b.quantized) == 0.0);
  CHECK(max_abs_diff(a.loss, b.loss) < 1e-7);
  // In eval the beam of 4 finds a path at least as good in weighted score.
  greedy.eval();
  beam.eval();
  const QuantizeOutput ge = greedy.forward(x), be = beam.forward(x);
  const double greedy_error = sum(square(ge.quantized - x)).item();
  const double beam_error = sum(square(be.quantized - x)).item();
  CHECK(beam_error <= greedy_error * (1 + 1e-6));
  Generator g3(11);
  ResidualVQOptions bad = o;
  bad.beam_size = 0;
  CHECK_THROWS_WITH_AS(ResidualVQ(bad, g3), doctest::Contains("eval_beam_size needs beam_size"),
                       std::invalid_argument);
  bad = o;
  bad.beam_score_quantizer_weights = {1.0, 1.0};
  CHECK_THROWS_WITH_AS(ResidualVQ(bad, g3), doctest::Contains("2 weights for 3 quantizers"),
                       std::invalid_argument);
}

TEST_CASE("beam search and DiVeQ on a device: no host reads, the CPU's numbers on sim") {
  ResidualVQOptions o;
  o.dim = 4;
  o.codebook_dim = 3;
  o.num_quantizers = 3;
  o.codebook_sizes = {6};
  o.beam_size = 2;
  o.layer.threshold_ema_dead_code = 0.5;
  ResidualVQOptions d = o;
  d.beam_size = 0;
  d.diveq = true;
  for (const ResidualVQOptions& opts : {o, d}) {
    Generator data(12);
    const Tensor x = randn({2, 5, 4}, data);
    // No mask: a masked step reads the valid count back (Codebook::accumulate).
    Generator g0(13);
    ResidualVQ cpu(opts, g0);
    Tensor xc = x.clone();
    xc.requires_grad_(true);
    const QuantizeOutput ref = cpu.forward(xc);
    sum(ref.quantized * ref.quantized).backward();
    for (const Device device : testing::test_devices()) {
      CAPTURE(device.str());
      Generator g(13);
      ResidualVQ rvq(opts, g);
      rvq.to(device);
      Tensor xd = x.to(device);
      xd.requires_grad_(true);
      QuantizeOutput out;
      {
        HostSyncGuard guard("a beam-search or DiVeQ training step");
        out = rvq.forward(xd);
        sum(out.quantized * out.quantized).backward();
      }
      if (!device.is_sim()) continue;  // a GPU sums in other orders
      CHECK(max_abs_diff(out.quantized.to(Device::cpu()), ref.quantized) == 0.0);
      CHECK(out.indices.to(Device::cpu()).to_vector<int64_t>() == ref.indices.to_vector<int64_t>());
      CHECK(max_abs_diff(xd.grad().to(Device::cpu()), xc.grad()) == 0.0);
      for (int64_t i = 0; i < 3; ++i)
        CHECK(max_abs_diff(rvq.layer(i).codebook().embed().to(Device::cpu()),
                           cpu.layer(i).codebook().embed()) == 0.0);
    }
  }
}
