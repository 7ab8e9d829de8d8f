// VectorQuantize invariants: nearest codes, the EMA formula on a hand-computed
// case, masks, dead-code replacement, k-means, zero-size batches, explicit
// state updates, lookups and layouts.
#include <doctest/doctest.h>

#include <cmath>
#include <set>

#include "quant/vq/kmeans.h"
#include "quant/vq/nearest_code.h"
#include "quant/vq/vector_quantize.h"
#include "quanta.h"
#include "support/gpu.h"
#include "vq_test_util.h"

using namespace quanta;
using namespace quanta::quant;
using quanta::testing::max_abs_diff;

namespace {

VectorQuantizeOptions small(int64_t dim, int64_t k) {
  VectorQuantizeOptions o;
  o.dim = dim;
  o.codebook_size = k;
  return o;
}

void set_codes(VectorQuantize& vq, const Tensor& embed) {
  NoGradGuard no_grad;
  copy_(vq.codebook().embed(), embed);
  copy_(vq.codebook().embed_avg(), embed);
}

}  // namespace

TEST_CASE("indices are the true nearest codes") {
  Generator gen(1);
  VectorQuantize vq(small(5, 23), gen);
  vq.eval();
  const Tensor x = randn({3, 11, 5}, gen) * 0.1;
  const auto idx = vq.forward(x).indices.to_vector<int64_t>();
  const auto xv = x.to_vector<double>();
  const auto cv = vq.codebook().embed().to_vector<double>();
  for (int64_t t = 0; t < 33; ++t) {
    int64_t best = 0;
    double bd = 1e300;
    for (int64_t k = 0; k < 23; ++k) {
      double d = 0;
      for (int e = 0; e < 5; ++e) d += std::pow(xv[t * 5 + e] - cv[k * 5 + e], 2);
      if (d < bd) bd = d, best = k;
    }
    CHECK(idx[t] == best);
  }
}

TEST_CASE("EMA update follows the formula on a hand-computed case") {
  Generator gen(2);
  VectorQuantizeOptions o = small(2, 2);
  o.decay = 0.5;
  o.eps = 1e-5;
  VectorQuantize vq(o, gen);
  set_codes(vq, from_vector<float>({0, 0, 10, 10}, {1, 2, 2}));
  const Tensor x = from_vector<float>({1, 1, 2, 0, 9, 9}, {1, 3, 2});
  QuantizeOutput out = vq.forward(x);
  CHECK(out.indices.to_vector<int64_t>() == std::vector<int64_t>{0, 0, 1});
  // n = [2, 1], sums = [[3, 1], [9, 9]]; cluster_size = 0.5 * 1 + 0.5 * n.
  const std::vector<double> cs{1.5, 1.0};
  const std::vector<double> avg{0.5 * 0 + 0.5 * 3, 0.5 * 0 + 0.5 * 1, 0.5 * 10 + 0.5 * 9,
                                0.5 * 10 + 0.5 * 9};
  CHECK(max_abs_diff(vq.codebook().cluster_size(), from_vector<double>(cs)) < 1e-6);
  CHECK(max_abs_diff(vq.codebook().embed_avg(), from_vector<double>(avg)) < 1e-6);
  const double n = 2.5, eps = 1e-5;
  std::vector<double> embed(4);
  for (int k = 0; k < 2; ++k) {
    const double smoothed = (cs[k] + eps) / (n + 2 * eps) * n;
    embed[k * 2] = avg[k * 2] / smoothed;
    embed[k * 2 + 1] = avg[k * 2 + 1] / smoothed;
  }
  CHECK(max_abs_diff(vq.codebook().embed(), from_vector<double>(embed)) < 1e-5);
  // The output is the code before this forward's update.
  CHECK(max_abs_diff(out.quantized, from_vector<float>({0, 0, 0, 0, 10, 10}, {1, 3, 2})) < 1e-6);
}

TEST_CASE("masked tokens change nothing: outputs, losses and EMA state") {
  Generator g1(3), g2(3), data(4);
  VectorQuantizeOptions o = small(4, 9);
  VectorQuantize a(o, g1), b(o, g2);
  Tensor x = randn({2, 6, 4}, data);
  const std::vector<uint8_t> keep{1, 1, 0, 1, 0, 1, 0, 1, 1, 1, 1, 0};
  // Garbage under the mask must not matter.
  std::vector<float> xv = x.to_vector<float>(), valid_rows;
  for (int t = 0; t < 12; ++t)
    for (int e = 0; e < 4; ++e) {
      if (!keep[t])
        xv[t * 4 + e] = 1e6f;
      else
        valid_rows.push_back(xv[t * 4 + e]);
    }
  x = from_vector<float>(xv, {2, 6, 4});
  const Tensor mask = to_dtype(from_vector<uint8_t>(keep, {2, 6}), DType::boolean);
  const int64_t nv = static_cast<int64_t>(valid_rows.size() / 4);
  QuantizeOutput oa = a.forward(x, mask);
  QuantizeOutput ob = b.forward(from_vector<float>(valid_rows, {1, nv, 4}));
  const auto ia = oa.indices.to_vector<int64_t>(), ib = ob.indices.to_vector<int64_t>();
  const auto qa = oa.quantized.to_vector<float>(), qb = ob.quantized.to_vector<float>();
  int64_t j = 0;
  for (int t = 0; t < 12; ++t) {
    if (!keep[t]) {
      CHECK(ia[t] == -1);
      for (int e = 0; e < 4; ++e) CHECK(qa[t * 4 + e] == 0.0f);
      continue;
    }
    CHECK(ia[t] == ib[j]);
    for (int e = 0; e < 4; ++e) CHECK(qa[t * 4 + e] == doctest::Approx(qb[j * 4 + e]));
    ++j;
  }
  CHECK(oa.loss.item() == doctest::Approx(ob.loss.item()).epsilon(1e-6));
  CHECK(max_abs_diff(a.codebook().cluster_size(), b.codebook().cluster_size()) < 1e-6);
  CHECK(max_abs_diff(a.codebook().embed_avg(), b.codebook().embed_avg()) < 1e-5);
  CHECK(max_abs_diff(a.codebook().embed(), b.codebook().embed()) < 1e-5);
}

TEST_CASE("dead codes are replaced by rows of the batch") {
  Generator gen(5), data(6);
  VectorQuantizeOptions o = small(3, 8);
  o.threshold_ema_dead_code = 1.5;
  VectorQuantize vq(o, gen);
  std::vector<float> codes(8 * 3, 100.0f);
  for (int e = 0; e < 3; ++e) codes[e] = 0.0f;  // code 0 at the origin, the rest far away
  set_codes(vq, from_vector<float>(codes, {1, 8, 3}));
  const Tensor x = randn({1, 16, 3}, data) * 0.1;
  QuantizeOutput out = vq.forward(x);
  for (int64_t i : out.indices.to_vector<int64_t>()) CHECK(i == 0);
  const auto rows = x.to_vector<float>();
  const auto embed = vq.codebook().embed().to_vector<float>();
  const auto cs = vq.codebook().cluster_size().to_vector<float>();
  const auto avg = vq.codebook().embed_avg().to_vector<float>();
  CHECK(cs[0] == doctest::Approx(0.8 + 0.2 * 16));
  std::set<int> used;
  for (int k = 1; k < 8; ++k) {
    int match = -1;
    for (int t = 0; t < 16; ++t) {
      bool same = true;
      for (int e = 0; e < 3; ++e) same = same && embed[k * 3 + e] == rows[t * 3 + e];
      if (same) match = t;
    }
    CHECK_MESSAGE(match >= 0, "code " << k << " is not a row of the batch");
    used.insert(match);
    CHECK(cs[k] == doctest::Approx(1.5));
    for (int e = 0; e < 3; ++e) CHECK(avg[k * 3 + e] == doctest::Approx(embed[k * 3 + e] * 1.5));
  }
  CHECK(used.size() == 7);  // drawn without replacement from 16 rows
}

TEST_CASE("dead codes are replaced on the device without a read, as on the CPU") {
  // Three tables of 16 codes, each with a pool of 12 candidate rows: a step
  // where at most 12 codes of a table expire draws without replacement, one
  // where more expire draws with it. The device decides which codes expire
  // and where their rows come from without reading anything back, and ends
  // with the CPU's codebook bitwise.
  Generator data(16);
  VectorQuantizeOptions o = small(12, 16);
  o.heads = 3;
  o.codebook_dim = 4;
  o.separate_codebook_per_head = true;
  o.threshold_ema_dead_code = 0.9;
  const Tensor x = randn({1, 12, 12}, data);
  std::vector<std::vector<float>> embeds;
  std::vector<Device> devices{Device::cpu()};
  for (const Device d : testing::test_devices()) devices.push_back(d);
  for (const Device device : devices) {
    CAPTURE(device.str());
    Generator gen(17);
    VectorQuantize vq(o, gen);
    vq.to(device);
    const Tensor xd = x.to(device);
    vq.forward(xd);  // the first step: any one-off reads happen here
    {
      HostSyncGuard guard("a training step with dead-code replacement");
      for (int step = 0; step < 2; ++step) vq.forward(xd);
    }
    const std::vector<float> embed = vq.codebook().embed().to_vector<float>();
    const std::vector<float> size = vq.codebook().cluster_size().to_vector<float>();
    const std::vector<float> rows = x.to_vector<float>();
    // The codes the last step replaced hold the threshold as their cluster
    // size, and one of their table's rows of the batch as their code.
    int replaced = 0;
    for (int h = 0; h < 3; ++h)
      for (int k = 0; k < 16; ++k) {
        if (size[size_t(h * 16 + k)] != float(o.threshold_ema_dead_code)) continue;
        ++replaced;
        bool found = false;
        for (int t = 0; t < 12; ++t) {
          bool same = true;
          for (int e = 0; e < 4; ++e)
            same = same && embed[size_t((h * 16 + k) * 4 + e)] == rows[size_t(t * 12 + h * 4 + e)];
          found = found || same;
        }
        CHECK_MESSAGE(found, "table " << h << ", code " << k << " is not a row of the batch");
      }
    MESSAGE(device.str() << ": " << replaced << " codes replaced in the last step");
    CHECK(replaced >= 3);
    embeds.push_back(embed);
  }
  // sim runs the CPU's kernels: the same codebook, bit for bit. A GPU's sums
  // add in other orders, and three steps of nearest-code choices and expiry
  // near the threshold can then pick other codes (seen on an H200): there
  // the checks above (no host sync, every replaced code a batch row) hold.
  for (std::size_t i = 1; i < embeds.size(); ++i)
    if (devices[i].is_sim()) CHECK(embeds[i] == embeds[0]);
}

TEST_CASE("more expired codes than candidate rows: as many, chosen at random, take distinct rows") {
  // vector-quantize-pytorch 1.32: drawing every expired code's row with
  // replacement made duplicate codes; now the rest wait for a later step.
  Generator gen(18), data(19);
  VectorQuantizeOptions o = small(3, 8);
  o.threshold_ema_dead_code = 1e6;  // every code expires
  std::set<std::vector<int>> choices;
  for (uint64_t seed = 0; seed < 6; ++seed) {
    Generator g(seed);
    VectorQuantize vq(o, g);
    const Tensor x = randn({1, 3, 3}, data);
    vq.forward(x);
    const auto rows = x.to_vector<float>();
    const auto embed = vq.codebook().embed().to_vector<float>();
    const auto sizes = vq.codebook().cluster_size().to_vector<float>();
    std::vector<int> replaced, row_of;
    for (int k = 0; k < 8; ++k) {
      int row = -1;
      for (int t = 0; t < 3; ++t) {
        bool same = true;
        for (int e = 0; e < 3; ++e)
          same = same && embed[size_t(k * 3 + e)] == rows[size_t(t * 3 + e)];
        if (same) row = t;
      }
      if (row >= 0) {
        replaced.push_back(k);
        row_of.push_back(row);
        CHECK(sizes[size_t(k)] == 1e6f);  // reset to the threshold
      } else {
        CHECK(sizes[size_t(k)] < 1e6f);  // still expired: replaced at a later step
      }
    }
    CHECK(replaced.size() == 3);
    CHECK(std::set<int>(row_of.begin(), row_of.end()).size() == 3);  // no duplicate codes
    choices.insert(replaced);
  }
  CHECK(choices.size() > 1);  // the replaced codes are drawn, not the first three
}

TEST_CASE("k-means: distortion never increases with more iterations") {
  Generator data(7);
  const Tensor centres = randn({5, 3}, data) * 3.0;
  const Tensor pick = randint(0, 5, {400}, data);
  const Tensor samples = index_select(centres, 0, pick) + randn({400, 3}, data) * 0.3;
  for (bool cosine : {false, true}) {
    const Tensor s = cosine ? l2norm(samples) : samples;
    double prev = 1e300;
    for (int iters = 0; iters <= 8; ++iters) {
      Generator g(11);  // same seeds every time: only the iteration count changes
      const KMeansResult r = kmeans(s, 6, iters, cosine, g);
      const double d = kmeans_distortion(s, r.means, cosine);
      CHECK(d <= prev * (1 + 1e-6));
      prev = d;
    }
  }
}

TEST_CASE("k-means with 0 iterations: the seeds, and bins that count the rows nearest each") {
  // All-zero bins started the codebook's EMA cluster sizes at 0 and its
  // codes at embed_avg / 0: `quanta train --kmeans-iters 0` diverged.
  Generator data(7), g(11);
  const Tensor samples = randn({50, 3}, data);
  const KMeansResult r = kmeans(samples, 4, 0, false, g);
  const Tensor nearest = nearest_codes(samples, r.means, false);
  std::vector<float> want(4, 0.0f);
  for (int64_t i : nearest.to_vector<int64_t>()) want[size_t(i)] += 1;
  CHECK(r.bins.to_vector<float>() == want);
  CHECK(sum(r.bins).item() == 50.0);
  // The means are rows of the samples, as drawn.
  Generator again(11);
  CHECK(r.means.to_vector<float>() == sample_rows(samples, 4, again).to_vector<float>());
}

TEST_CASE("kmeans_init initialises the codebook on the first forward") {
  Generator gen(8), data(9);
  VectorQuantizeOptions o = small(3, 4);
  o.kmeans_init = true;
  VectorQuantize vq(o, gen);
  CHECK_FALSE(vq.codebook().initted());
  CHECK(sum(abs(vq.codebook().embed())).item() == 0.0);
  vq.eval();
  vq.forward(randn({2, 32, 3}, data));
  CHECK(vq.codebook().initted());
  CHECK(sum(abs(vq.codebook().embed())).item() > 0.0);
}

TEST_CASE("initted is read from the host, and follows a loaded state both ways") {
  // The forward consults initted every step: a host copy, never a device
  // read, which load_state_dict (and DataParallel's broadcasts) refresh.
  Generator gen(8), data(9);
  VectorQuantizeOptions o = small(3, 4);
  o.kmeans_init = true;
  VectorQuantize fresh(o, gen), trained(o, gen), untrained(o, gen);
  trained.forward(randn({2, 32, 3}, data));
  REQUIRE(trained.codebook().initted());
  fresh.load_state_dict(trained.state_dict());
  CHECK(fresh.codebook().initted());
  trained.load_state_dict(untrained.state_dict());
  CHECK_FALSE(trained.codebook().initted());
  for (const Device device : testing::test_devices()) {
    CAPTURE(device.str());
    VectorQuantize vq(o, gen);
    vq.to(device);
    vq.eval();
    vq.forward(randn({2, 32, 3}, data).to(device));  // k-means on the first batch
    HostSyncGuard guard("the forwards after k-means");
    CHECK(vq.codebook().initted());
  }
}

TEST_CASE("zero-size batches give zero-size outputs and zero loss") {
  Generator gen(10);
  for (bool separate : {false, true}) {
    VectorQuantizeOptions o = small(6, 5);
    o.heads = 2;
    o.codebook_dim = 3;
    o.separate_codebook_per_head = separate;
    o.threshold_ema_dead_code = 1;
    VectorQuantize vq(o, gen);
    Tensor x = zeros({0, 4, 6});
    x.requires_grad_(true);
    QuantizeOutput out = vq.forward(x);
    CHECK(out.quantized.shape() == Shape{0, 4, 6});
    CHECK(out.indices.shape() == Shape{0, 4, 2});
    CHECK(out.loss.item() == 0.0);
    for (const auto& [name, t] : out.losses) CHECK_MESSAGE(std::isfinite(t.item()), name);
    (sum(out.quantized) + out.loss).backward();
    CHECK(std::isfinite(sum(vq.codebook().embed()).item()));
    vq.eval();
    CHECK(vq.forward(zeros({0, 6})).quantized.shape() == Shape{0, 6});
  }
}

TEST_CASE("update_in_forward off: the forward only accumulates") {
  Generator g1(12), g2(12), data(13);
  VectorQuantizeOptions o = small(4, 6);
  VectorQuantize eager(o, g1);
  o.update_in_forward = false;
  VectorQuantize lazy(o, g2);
  const Tensor x = randn({2, 10, 4}, data);
  const Tensor before = lazy.codebook().embed().clone();
  eager.forward(x);
  lazy.forward(x);
  CHECK(max_abs_diff(lazy.codebook().embed(), before) == 0.0);
  CHECK(lazy.codebook().pending().steps == 1);
  CHECK(sum(lazy.codebook().pending().tokens).item() == 20.0);
  lazy.update_state();
  CHECK(lazy.codebook().pending().empty());
  CHECK(max_abs_diff(lazy.codebook().embed(), eager.codebook().embed()) < 1e-6);
  CHECK(max_abs_diff(lazy.codebook().cluster_size(), eager.codebook().cluster_size()) < 1e-6);
}

TEST_CASE("eval and frozen codebooks leave the state alone") {
  Generator gen(14), data(15);
  VectorQuantizeOptions o = small(4, 6);
  o.freeze_codebook = true;
  VectorQuantize vq(o, gen);
  const Tensor before = vq.codebook().embed().clone();
  vq.forward(randn({2, 5, 4}, data));
  CHECK(max_abs_diff(vq.codebook().embed(), before) == 0.0);
  VectorQuantize ev(small(4, 6), gen);
  ev.eval();
  const Tensor b2 = ev.codebook().embed().clone();
  QuantizeOutput out = ev.forward(randn({2, 5, 4}, data));
  CHECK(out.loss.item() == 0.0);
  CHECK(max_abs_diff(ev.codebook().embed(), b2) == 0.0);
}

TEST_CASE("lookups reproduce the eval forward, with heads and projections") {
  Generator gen(16), data(17);
  VectorQuantizeOptions o = small(8, 12);
  o.heads = 2;
  o.codebook_dim = 3;
  o.separate_codebook_per_head = true;
  VectorQuantize vq(o, gen);
  vq.eval();
  const Tensor x = randn({2, 7, 8}, data);
  QuantizeOutput out = vq.forward(x);
  CHECK(out.indices.shape() == Shape{2, 7, 2});
  CHECK(max_abs_diff(vq.get_output_from_indices(out.indices), out.quantized) < 1e-6);
  CHECK(vq.get_codes_from_indices(out.indices).shape() == Shape{2, 7, 6});
  // -1 gives a zero code.
  const Tensor none = full({1, 1, 2}, -1.0, {.dtype = DType::i64});
  CHECK(sum(abs(vq.get_codes_from_indices(none))).item() == 0.0);
}

TEST_CASE("image feature maps: [B, D, H, W] in, indices [B, H, W]") {
  Generator gen(18), data(19);
  VectorQuantizeOptions o = small(4, 6);
  o.accept_image_fmap = true;
  VectorQuantize vq(o, gen);
  vq.eval();
  const Tensor x = randn({2, 4, 3, 5}, data);
  QuantizeOutput out = vq.forward(x);
  CHECK(out.quantized.shape() == x.shape());
  CHECK(out.indices.shape() == Shape{2, 3, 5});
  // Channel-last view of the same tokens gives the same indices.
  VectorQuantize& same = vq;
  const Tensor tokens = contiguous(permute(x, {0, 2, 3, 1}));
  CHECK(max_abs_diff(same.forward(reshape(tokens, {2, 15, 4})).indices,
                     reshape(out.indices, {2, 15})) == 0.0);
  VectorQuantize plain(small(4, 6), gen);
  CHECK_THROWS_AS(plain.forward(x), std::invalid_argument);
}

TEST_CASE("options: losses, stochastic sampling and straight-through run and are finite") {
  Generator gen(20), data(21);
  VectorQuantizeOptions o = small(6, 10);
  o.orthogonal_reg_weight = 0.1;
  o.orthogonal_reg_active_codes_only = true;
  o.orthogonal_reg_max_codes = 4;
  o.codebook_diversity_loss_weight = 0.1;
  o.commitment_use_cross_entropy_loss = true;
  o.stochastic_sample_codes = true;
  o.use_cosine_sim = true;
  VectorQuantize vq(o, gen);
  Tensor x = randn({2, 8, 6}, data);
  x.requires_grad_(true);
  QuantizeOutput out = vq.forward(x);
  (sum(out.quantized) + out.loss).backward();
  CHECK(std::isfinite(out.loss.item()));
  CHECK(out.term("orthogonal_reg").item() != 0.0);
  CHECK(out.term("codebook_diversity").item() < 0.0);
  CHECK(x.grad().defined());
  o = small(6, 10);
  o.straight_through = true;
  VectorQuantize st(o, gen);
  Tensor x2 = randn({2, 8, 6}, data);
  x2.requires_grad_(true);
  QuantizeOutput o2 = st.forward(x2);
  sum(o2.quantized).backward();
  CHECK(std::isfinite(sum(x2.grad()).item()));
  // forward with given indices: cross entropy over the distances.
  st.eval();
  QuantizeOutput ce = st.forward_with_indices(x2.detach(), st.forward(x2.detach()).indices);
  CHECK(ce.loss.item() > 0.0);
  CHECK(std::isfinite(ce.loss.item()));
}

TEST_CASE("orthogonal loss: orthonormal codes give 0, identical codes 1 - 1/n") {
  Generator gen(22);
  VectorQuantizeOptions o = small(4, 4);
  o.orthogonal_reg_weight = 1.0;
  o.ema_update = false;
  VectorQuantize vq(o, gen);
  set_codes(vq, reshape(eye(4) * 3.0, {1, 4, 4}));
  CHECK(std::abs(vq.forward(randn({1, 3, 4}, gen)).term("orthogonal_reg").item()) < 1e-6);
  set_codes(vq, ones({1, 4, 4}));
  CHECK(vq.forward(randn({1, 3, 4}, gen)).term("orthogonal_reg").item() ==
        doctest::Approx(1.0 - 1.0 / 4));
}

TEST_CASE("convergence: a mixture of Gaussians is recovered with dead-code expiry") {
  Generator gen(30), data(31);
  // Twice as many codes as centres: a code then never has to straddle two
  // centres, and every code stays in use.
  const int64_t k = 8, dim = 4, codes = 16;
  const Tensor centres = randn({k, dim}, data) * 3.0;
  VectorQuantizeOptions o = small(dim, codes);
  o.decay = 0.8;
  o.threshold_ema_dead_code = 4;
  VectorQuantize vq(o, gen);
  auto batch = [&](int64_t n) {
    const Tensor pick = randint(0, k, {n}, data);
    return reshape(index_select(centres, 0, pick) + randn({n, dim}, data) * 0.05, {1, n, dim});
  };
  for (int step = 0; step < 150; ++step) vq.forward(batch(256));
  vq.eval();
  const auto used = vq.forward(batch(1024)).indices.to_vector<int64_t>();
  const std::set<int64_t> distinct(used.begin(), used.end());
  CHECK(double(distinct.size()) >= 0.95 * double(codes));
  // Every centre has a code close to it.
  const auto cv = vq.codebook().embed().to_vector<double>();
  const auto mv = centres.to_vector<double>();
  for (int64_t c = 0; c < k; ++c) {
    double best = 1e300;
    for (int64_t j = 0; j < codes; ++j) {
      double d = 0;
      for (int64_t e = 0; e < dim; ++e) d += std::pow(cv[j * dim + e] - mv[c * dim + e], 2);
      best = std::min(best, std::sqrt(d));
    }
    CHECK_MESSAGE(best < 0.1, "centre " << c << " is " << best << " from its nearest code");
  }
}

TEST_CASE("affine_param: codes follow the batch statistics") {
  Generator gen(40), data(41);
  VectorQuantizeOptions o = small(3, 16);
  o.affine_param = true;
  VectorQuantize vq(o, gen);
  const Tensor x = randn({4, 64, 3}, data) * 2.0 + 5.0;
  vq.forward(x);
  Codebook& cb = vq.codebook();
  const Tensor rows = reshape(x, {256, 3});
  CHECK(max_abs_diff(reshape(cb.find("batch_mean"), {3}), mean(rows, {0})) < 1e-4);
  CHECK(max_abs_diff(reshape(cb.find("batch_variance"), {3}), var(rows, {0}, 0.0)) < 1e-3);
  // The codes the distances use sit where the batch is.
  const Tensor moved = cb.affine_codes(cb.embed().detach());
  CHECK(max_abs_diff(mean(moved, {0, 1}), cb.find("batch_mean").reshape({3})) < 0.5);
  // Every index is valid and the EMA saw inputs mapped back to code space.
  vq.eval();
  for (int64_t i : vq.forward(x).indices.to_vector<int64_t>()) CHECK((i >= 0 && i < 16));
  CHECK(std::isfinite(sum(cb.embed()).item()));
}

TEST_CASE("affine_param: state under vector-quantize-pytorch's names, and it moves both ways") {
  Generator gen(42), data(43);
  VectorQuantizeOptions o = small(3, 16);
  o.affine_param = true;
  VectorQuantize vq(o, gen);
  Codebook& cb = vq.codebook();
  // EuclideanCodebook(affine_param=True)'s buffers, once the statistics exist.
  std::set<std::string> keys;
  for (const auto& [k, v] : cb.state_dict()) keys.insert(k);
  for (const char* k : {"embed", "embed_avg", "cluster_size", "initted", "batch_mean",
                        "batch_variance", "codebook_mean", "codebook_mean_needs_init",
                        "codebook_variance", "codebook_variance_needs_init"})
    CHECK_MESSAGE(keys.count(k) == 1, k);
  CHECK(keys.size() == 10);
  // torch.Tensor([True]): float32 [1], 1 until the first update.
  CHECK(cb.find("codebook_mean_needs_init").dtype() == DType::f32);
  CHECK(cb.find("codebook_mean_needs_init").shape() == Shape{1});
  CHECK(cb.find("codebook_mean_needs_init").item() == 1.0);
  const Tensor x = randn({4, 64, 3}, data) * 2.0 + 5.0;
  vq.forward(x);
  CHECK(cb.find("codebook_mean_needs_init").item() == 0.0);
  CHECK(cb.find("codebook_variance_needs_init").item() == 0.0);
  // A fresh layer given the trained state maps codes exactly as the trained one.
  Generator other(7);
  VectorQuantize copy(o, other);
  copy.load_state_dict(vq.state_dict());
  const Tensor codes = cb.embed().detach();
  CHECK(max_abs_diff(copy.codebook().affine_codes(codes), cb.affine_codes(codes)) == 0.0);
  // Still flagged for init: the statistics are not applied.
  VectorQuantize fresh(o, other);
  CHECK(max_abs_diff(fresh.codebook().affine_codes(codes), codes) == 0.0);
}
