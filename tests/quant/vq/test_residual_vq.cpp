// ResidualVQ and GroupedResidualVQ: dropout, gradients, lookups, zero-size.
#include <doctest/doctest.h>

#include <cmath>
#include <set>

#include "quant/vq/residual_vq.h"
#include "quanta.h"
#include "vq_test_util.h"

using namespace quanta;
using namespace quanta::quant;
using quanta::testing::max_abs_diff;

namespace {

ResidualVQOptions rvq_opts(int64_t dim, int64_t q, int64_t k) {
  ResidualVQOptions o;
  o.dim = dim;
  o.num_quantizers = q;
  o.codebook_sizes = {k};
  return o;
}

}  // namespace

TEST_CASE("ResidualVQ STE: input gradient is (active layers) x upstream") {
  Generator gen(1), data(2);
  ResidualVQOptions o = rvq_opts(5, 3, 7);
  o.layer.rotation_trick = false;
  o.layer.commitment_weight = 0;
  ResidualVQ rvq(o, gen);
  Tensor x = randn({2, 4, 5}, data);
  x.requires_grad_(true);
  const Tensor w = randn({2, 4, 5}, data);
  QuantizeOutput out = rvq.forward(x);
  CHECK(out.indices.shape() == Shape{2, 4, 3});
  CHECK(out.loss.shape() == Shape{3});
  sum(out.quantized * w).backward();
  CHECK(max_abs_diff(x.grad(), w * 3.0) < 1e-6);
}

TEST_CASE("ResidualVQ quantize dropout: -1 indices and zero loss after the kept layer") {
  Generator gen(3), data(4);
  ResidualVQOptions o = rvq_opts(4, 6, 5);
  o.quantize_dropout = true;
  o.quantize_dropout_cutoff_index = 1;
  o.quantize_dropout_multiple_of = 2;
  ResidualVQ rvq(o, gen);
  std::set<int64_t> seen;
  for (int trial = 0; trial < 12; ++trial) {
    QuantizeOutput out = rvq.forward(randn({2, 3, 4}, data));
    const auto idx = out.indices.to_vector<int64_t>();
    const auto loss = out.loss.to_vector<double>();
    int64_t kept = 0;
    while (kept < 6 && idx[kept] != -1) ++kept;
    seen.insert(kept);
    CHECK((kept % 2 == 0 && kept >= 2));  // k + 1 a multiple of 2, k >= cutoff
    for (int64_t t = 0; t < 6; ++t)
      for (int64_t q = 0; q < 6; ++q) CHECK((idx[t * 6 + q] == -1) == (q >= kept));
    for (int64_t q = kept; q < 6; ++q) CHECK(loss[q] == 0.0);
  }
  CHECK(seen.size() > 1);
  // The same seed draws the same layers.
  Generator g1(5), g2(5);
  ResidualVQ a(o, g1), b(o, g2);
  for (int i = 0; i < 5; ++i) CHECK(a.draw_dropout() == b.draw_dropout());
  // No dropout in eval.
  rvq.eval();
  for (int64_t i : rvq.forward(randn({1, 3, 4}, data)).indices.to_vector<int64_t>()) CHECK(i >= 0);
}

TEST_CASE("ResidualVQ lookups reproduce the eval forward (projections, fewer layers)") {
  Generator gen(6), data(7);
  ResidualVQOptions o = rvq_opts(8, 3, 9);
  o.codebook_dim = 5;
  ResidualVQ rvq(o, gen);
  rvq.eval();
  const Tensor x = randn({2, 4, 8}, data);
  QuantizeOutput out = rvq.forward(x);
  CHECK(max_abs_diff(rvq.get_output_from_indices(out.indices), out.quantized) < 1e-5);
  const Tensor codes = rvq.get_codes_from_indices(out.indices);
  CHECK(codes.shape() == Shape{3, 2, 4, 5});
  // Two of three layers: the third contributes zeros.
  const Tensor two = rvq.get_codes_from_indices(slice(out.indices, -1, 0, 2));
  CHECK(max_abs_diff(select(two, 0, 1), select(codes, 0, 1)) == 0.0);
  CHECK(sum(abs(select(two, 0, 2))).item() == 0.0);
}

TEST_CASE("ResidualVQ shared codebook: one table, updated once per forward") {
  Generator gen(8), data(9);
  ResidualVQOptions o = rvq_opts(4, 3, 6);
  o.shared_codebook = true;
  ResidualVQ rvq(o, gen);
  CHECK(&rvq.layer(1).codebook() == &rvq.layer(0).codebook());
  rvq.forward(randn({2, 5, 4}, data));
  CHECK(rvq.layer(0).codebook().pending().empty());
  const StateDict sd = rvq.state_dict();
  CHECK(find_tensor(sd, "layers.2._codebook.embed") != nullptr);
}

TEST_CASE("ResidualVQ and GroupedResidualVQ handle zero-size batches") {
  Generator gen(10);
  ResidualVQ rvq(rvq_opts(4, 2, 5), gen);
  Tensor x = zeros({0, 3, 4});
  x.requires_grad_(true);
  QuantizeOutput out = rvq.forward(x);
  CHECK(out.quantized.shape() == Shape{0, 3, 4});
  CHECK(out.indices.shape() == Shape{0, 3, 2});
  CHECK(sum(out.loss).item() == 0.0);
  (sum(out.quantized) + sum(out.loss)).backward();
  GroupedResidualVQOptions go;
  go.dim = 4;
  go.groups = 2;
  go.rvq = rvq_opts(4, 2, 5);
  GroupedResidualVQ grvq(go, gen);
  QuantizeOutput g = grvq.forward(zeros({0, 3, 4}));
  CHECK(g.indices.shape() == Shape{2, 0, 3, 2});
  CHECK(g.loss.shape() == Shape{2, 2});
}

TEST_CASE("GroupedResidualVQ: groups drop alike, lookups match") {
  Generator gen(11), data(12);
  GroupedResidualVQOptions go;
  go.dim = 6;
  go.groups = 3;
  go.rvq = rvq_opts(6, 4, 5);
  go.rvq.quantize_dropout = true;
  GroupedResidualVQ grvq(go, gen);
  QuantizeOutput out = grvq.forward(randn({2, 3, 6}, data));
  CHECK(out.indices.shape() == Shape{3, 2, 3, 4});
  const Tensor dropped = eq(out.indices, full_like(out.indices, -1.0));
  for (int64_t g = 1; g < 3; ++g)
    CHECK(max_abs_diff(select(dropped, 0, g), select(dropped, 0, 0)) == 0.0);
  grvq.eval();
  const Tensor x = randn({2, 3, 6}, data);
  QuantizeOutput ev = grvq.forward(x);
  CHECK(max_abs_diff(grvq.get_output_from_indices(ev.indices), ev.quantized) < 1e-5);
  CHECK(grvq.get_codes_from_indices(ev.indices).shape() == Shape{3, 4, 2, 3, 2});
}

TEST_CASE(
    "ResidualVQ per-layer codebook sizes {8, 16, 4}: shapes, ranges, nearest codes, lookups") {
  Generator gen(13), data(14);
  ResidualVQOptions o;
  o.dim = 5;
  o.codebook_sizes = {8, 16, 4};  // num_quantizers 0: the length of the list
  ResidualVQ rvq(o, gen);
  REQUIRE(rvq.num_quantizers() == 3);
  const std::vector<int64_t> sizes{8, 16, 4};
  const StateDict sd = rvq.state_dict();
  for (int64_t i = 0; i < 3; ++i) {
    CHECK(rvq.layer(i).codebook().embed().shape() == Shape{1, sizes[i], 5});
    const Tensor* e = find_tensor(sd, "layers." + std::to_string(i) + "._codebook.embed");
    REQUIRE(e != nullptr);
    CHECK(e->shape() == Shape{1, sizes[i], 5});
  }
  const Tensor x = randn({4, 50, 5}, data);
  QuantizeOutput train = rvq.forward(x);
  CHECK(train.indices.shape() == Shape{4, 50, 3});
  CHECK(train.loss.shape() == Shape{3});
  rvq.eval();
  QuantizeOutput out = rvq.forward(x);
  // Layer i picks, among its own K_i codes, the nearest to what the layers
  // before it left; brute force in f64.
  const auto idx = out.indices.to_vector<int64_t>();
  std::vector<double> residual = x.to_vector<double>();
  std::vector<std::set<int64_t>> used(3);
  for (int64_t i = 0; i < 3; ++i) {
    const auto codes = rvq.layer(i).codebook().embed().to_vector<double>();
    for (int64_t t = 0; t < 200; ++t) {
      int64_t best = 0;
      double bd = 1e300;
      for (int64_t k = 0; k < sizes[i]; ++k) {
        double d = 0;
        for (int e = 0; e < 5; ++e) d += std::pow(residual[t * 5 + e] - codes[k * 5 + e], 2);
        if (d < bd) bd = d, best = k;
      }
      const int64_t got = idx[t * 3 + i];
      CHECK((got >= 0 && got < sizes[i]));
      CHECK(got == best);
      used[i].insert(got);
      for (int e = 0; e < 5; ++e) residual[t * 5 + e] -= codes[got * 5 + e];
    }
  }
  CHECK(*used[1].rbegin() >= 8);  // layer 1 reaches past layer 0's size
  // Lookups: each layer's rows of its own table, and their sum is the output.
  const Tensor codes = rvq.get_codes_from_indices(out.indices);
  CHECK(codes.shape() == Shape{3, 4, 50, 5});
  for (int64_t i = 0; i < 3; ++i) {
    const Tensor own = index_select(reshape(rvq.layer(i).codebook().embed(), {sizes[i], 5}), 0,
                                    reshape(select(out.indices, -1, i), {200}));
    CHECK(max_abs_diff(reshape(select(codes, 0, i), {200, 5}), own) == 0.0);
  }
  CHECK(max_abs_diff(rvq.get_output_from_indices(out.indices), out.quantized) < 1e-5);
  // A list that disagrees with num_quantizers is refused.
  o.num_quantizers = 2;
  CHECK_THROWS_WITH_AS(ResidualVQ(o, gen), doctest::Contains("codebook_sizes"),
                       std::invalid_argument);
}

TEST_CASE("ResidualVQ mask: masked tokens get zero output, -1 in every layer, no EMA share") {
  const std::vector<uint8_t> keep{1, 0, 1, 1, 0, 1, 1, 1, 0, 1};
  Generator data(15);
  Tensor x = randn({2, 5, 4}, data);
  std::vector<float> xv = x.to_vector<float>(), valid_rows;
  for (int t = 0; t < 10; ++t)
    for (int e = 0; e < 4; ++e) {
      if (!keep[t])
        xv[t * 4 + e] = 1e3f;  // garbage under the mask must not matter
      else
        valid_rows.push_back(xv[t * 4 + e]);
    }
  x = from_vector<float>(xv, {2, 5, 4});
  const Tensor mask = to_dtype(from_vector<uint8_t>(keep, {2, 5}), DType::boolean);
  const int64_t nv = static_cast<int64_t>(valid_rows.size() / 4);
  for (int64_t codebook_dim : {0, 3}) {
    CAPTURE(codebook_dim);
    Generator g1(16), g2(16);
    ResidualVQOptions o = rvq_opts(4, 3, 6);
    o.codebook_dim = codebook_dim;
    ResidualVQ masked(o, g1), truncated(o, g2);
    const QuantizeOutput a = masked.forward(x, mask);
    const QuantizeOutput b = truncated.forward(from_vector<float>(valid_rows, {1, nv, 4}));
    const auto ia = a.indices.to_vector<int64_t>(), ib = b.indices.to_vector<int64_t>();
    const auto qa = a.quantized.to_vector<float>(), qb = b.quantized.to_vector<float>();
    // Masked rows output zeros, after project_out too (vector-quantize-pytorch
    // 1.32; 1.31 gave project_out's bias there).
    const std::vector<float> pad(4, 0.0f);
    int64_t j = 0;
    for (int t = 0; t < 10; ++t) {
      if (!keep[t]) {
        for (int q = 0; q < 3; ++q) CHECK(ia[t * 3 + q] == -1);
        for (int e = 0; e < 4; ++e) CHECK(qa[t * 4 + e] == pad[e]);
        continue;
      }
      for (int q = 0; q < 3; ++q) CHECK(ia[t * 3 + q] == ib[j * 3 + q]);
      for (int e = 0; e < 4; ++e) CHECK(qa[t * 4 + e] == doctest::Approx(qb[j * 4 + e]));
      ++j;
    }
    CHECK(max_abs_diff(a.loss, b.loss) < 1e-6);
    for (int64_t i = 0; i < 3; ++i) {
      Codebook &ca = masked.layer(i).codebook(), &cb = truncated.layer(i).codebook();
      CHECK(max_abs_diff(ca.cluster_size(), cb.cluster_size()) < 1e-6);
      CHECK(max_abs_diff(ca.embed_avg(), cb.embed_avg()) < 1e-5);
      CHECK(max_abs_diff(ca.embed(), cb.embed()) < 1e-5);
    }
  }
}
