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
  for (int i = 0; i < 5; ++i) CHECK(a.draw_last_layer() == b.draw_last_layer());
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
