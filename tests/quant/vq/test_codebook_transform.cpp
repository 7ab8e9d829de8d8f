// The codebook transform hook (quant/vq/codebook_transform.h): FVQ's
// vq_bridge and QINCo's implicit neural codebook. The MLP against its
// definition and in f64 against finite differences, the codes' gradient
// through a bridge and through the last layer's MLP against finite
// differences, the resolved defaults and refusals, lookups equal to what
// the forward quantized with, and a training step on a device. quanta parity checks the numbers
// against vector-quantize-pytorch 1.32 (vq_bridge_mlp, rvq_*_qinco*).
#include <doctest/doctest.h>

#include "quant/vq/codebook_transform.h"
#include "quant/vq/residual_vq.h"
#include "quant/vq/vector_quantize.h"
#include "quanta.h"
#include "support/gpu.h"
#include "vq_test_util.h"

using namespace quanta;
using namespace quanta::quant;
using quanta::testing::max_abs_diff;
using quanta::testing::numeric_grad;

namespace {

const TensorOptions kF64{.dtype = DType::f64};

ResidualVQOptions qinco_options(int64_t num_quantizers = 3) {
  ResidualVQOptions o;
  o.dim = 4;
  o.num_quantizers = num_quantizers;
  o.codebook_sizes = {6};
  o.implicit_neural_codebook = true;
  o.mlp_depth = 2;
  o.mlp_dim_hidden = 5;
  return o;
}

}  // namespace

TEST_CASE("ImplicitCodebookMLP: proj_in of [condition, code], then residual SiLU blocks") {
  Generator gen(1), data(2);
  ImplicitCodebookMLP mlp(3, 5, 2, gen);
  mlp.to(DType::f64);
  const Tensor codes = randn({1, 4, 3}, data, kF64);
  const Tensor cond = randn({2, 3}, data, kF64);
  const Tensor out = mlp.forward(codes, cond);
  REQUIRE(out.shape() == Shape{1, 2, 4, 3});
  // The definition, token by token and code by code: x = W [z, c] + b, then
  // x + L2(silu(L1 x)) per block.
  const Tensor w = mlp.find("proj_in.weight"), b = mlp.find("proj_in.bias");
  for (int64_t t = 0; t < 2; ++t)
    for (int64_t k = 0; k < 4; ++k) {
      const Tensor zc = cat({select(cond, 0, t), select(select(codes, 0, 0), 0, k)});
      Tensor x = linear(zc, w, b);
      for (int i = 0; i < 2; ++i) {
        const std::string p = "layers." + std::to_string(i);
        const Tensor h = linear(x, mlp.find(p + ".0.weight"), mlp.find(p + ".0.bias"));
        x = x + linear(h * sigmoid(h), mlp.find(p + ".2.weight"), mlp.find(p + ".2.bias"));
      }
      CHECK(max_abs_diff(select(select(select(out, 0, 0), 0, t), 0, k), x) < 1e-12);
    }
  CHECK_THROWS_WITH_AS(mlp.forward(codes, Tensor()), doctest::Contains("needs a condition"),
                       std::invalid_argument);
}

TEST_CASE(
    "ImplicitCodebookMLP: f64 gradients of codes, condition and weights match finite differences") {
  Generator gen(3), data(4);
  ImplicitCodebookMLP mlp(3, 4, 2, gen);
  mlp.to(DType::f64);
  Tensor codes = randn({1, 5, 3}, data, kF64), cond = randn({2, 3}, data, kF64);
  const Tensor g = randn({1, 2, 5, 3}, data, kF64);
  codes.requires_grad_(true);
  cond.requires_grad_(true);
  sum(mlp.forward(codes, cond) * g).backward();
  const auto at = [&](const Tensor& c, const Tensor& z) {
    return sum(mlp.forward(c, z) * g).item();
  };
  CHECK(max_abs_diff(codes.grad(),
                     numeric_grad([&](const Tensor& c) { return at(c, cond.detach()); }, codes)) <
        1e-7);
  CHECK(max_abs_diff(cond.grad(),
                     numeric_grad([&](const Tensor& z) { return at(codes.detach(), z); }, cond)) <
        1e-7);
  for (const char* name : {"proj_in.weight", "layers.0.0.weight", "layers.1.2.bias"}) {
    CAPTURE(name);
    const Tensor p = mlp.find(name);
    CHECK(max_abs_diff(p.grad(),
                       numeric_grad(p, [&] { return at(codes.detach(), cond.detach()); })) < 1e-7);
  }
}

TEST_CASE("vq_bridge: learnable codes without EMA, quantizing with the bridged codes") {
  Generator gen(5), data(6);
  VectorQuantizeOptions o;
  o.dim = 4;
  o.codebook_size = 6;
  o.vq_bridge =
      std::make_shared<Sequential>(std::make_shared<Linear>(4, 4, gen), std::make_shared<Tanh>());
  VectorQuantize vq(o, gen);
  CHECK(vq.learnable_codebook());
  CHECK_FALSE(vq.ema_update());
  CHECK(vq.find("_codebook.vq_bridge.0.weight").defined());
  vq.to(DType::f64);
  const Tensor x = randn({2, 3, 4}, data, kF64);
  const QuantizeOutput out = vq.forward(x);
  // The chosen code is the nearest bridged code, and lookups see the bridge.
  const Tensor bridged = o.vq_bridge->forward(vq.codebook().embed().detach());     // [1, K, d]
  const Tensor d = sum(square(unsqueeze(reshape(x, {6, 4}), 1) - bridged), {-1});  // [6, K]
  CHECK(max_abs_diff(reshape(out.indices, {6}), argmin(d, -1)) == 0.0);
  CHECK(max_abs_diff(out.quantized, vq.get_output_from_indices(out.indices)) < 1e-12);
  // The commitment loss's gradient reaches the codes through the bridge:
  // finite differences in f64 (no choice moves for small steps).
  vq.zero_grad();
  vq.forward(x).loss.backward();
  const Tensor embed = vq.codebook().embed();
  const Tensor fd = numeric_grad(embed, [&] { return vq.forward(x).loss.item(); });
  CHECK(max_abs_diff(embed.grad(), fd) < 1e-7);
  CHECK(max_abs_diff(fd, zeros_like(fd)) > 1e-4);
  // Refusals: the bridge trains the codes by gradient.
  VectorQuantizeOptions bad = o;
  bad.ema_update = true;
  CHECK_THROWS_WITH_AS(VectorQuantize(bad, gen), doctest::Contains("ema_update off"),
                       std::invalid_argument);
  bad = o;
  bad.use_cosine_sim = true;
  CHECK_THROWS_WITH_AS(VectorQuantize(bad, gen), doctest::Contains("cosine"),
                       std::invalid_argument);
}

TEST_CASE("implicit neural codebook: layers 1.. quantize with MLP(code, running sum)") {
  Generator gen(7), data(8);
  ResidualVQ rvq(qinco_options(), gen);
  for (int64_t i = 0; i < 3; ++i) {
    CHECK(rvq.layer(i).learnable_codebook());
    CHECK_FALSE(rvq.layer(i).ema_update());
    CHECK(static_cast<bool>(rvq.layer(i).codebook_transform) == (i > 0));
  }
  CHECK(rvq.find("mlps.0.proj_in.weight").defined());
  CHECK(rvq.find("mlps.1.layers.1.2.bias").defined());
  CHECK_FALSE(rvq.find("mlps.2.proj_in.weight").defined());
  const Tensor x = randn({2, 5, 4}, data);
  rvq.eval();
  const QuantizeOutput out = rvq.forward(x);
  // A lookup derives the codes layer by layer as the forward did.
  CHECK(max_abs_diff(out.quantized, rvq.get_output_from_indices(out.indices)) < 1e-5);
  // Layer 1's codebook differs from token to token: the same index gives
  // different codes under different running sums.
  const Tensor codes = rvq.get_codes_from_indices(zeros({1, 2, 3}, {.dtype = DType::i64}));
  const Tensor cond = rvq.get_codes_from_indices(
      from_vector<int64_t>({0, 0, 0, 1, 0, 0}, {1, 2, 3}, {.dtype = DType::i64}));
  CHECK(max_abs_diff(select(select(codes, 0, 1), 1, 0), select(select(cond, 0, 1), 1, 1)) > 1e-4);
  // A dropped layer (-1) gives zeros.
  const Tensor dropped = rvq.get_codes_from_indices(
      from_vector<int64_t>({2, 3, -1}, {1, 1, 3}, {.dtype = DType::i64}));
  CHECK(max_abs_diff(select(dropped, 0, 2), zeros({1, 1, 4})) == 0.0);
}

TEST_CASE(
    "implicit neural codebook: f64 gradients of the last layer's MLP and codes match finite "
    "differences") {
  // Only the last layer's MLP and codes reach the loss by a true derivative
  // alone (earlier ones also move later residuals and conditions in value,
  // which the residual's stop-gradient leaves out by design).
  Generator gen(9), data(10);
  ResidualVQ rvq(qinco_options(), gen);
  rvq.to(DType::f64);
  const Tensor x = randn({2, 3, 4}, data, kF64);
  const auto loss = [&] { return sum(rvq.forward(x).loss).item(); };
  sum(rvq.forward(x).loss).backward();
  for (const char* name : {"mlps.1.proj_in.weight", "mlps.1.layers.0.0.weight",
                           "mlps.1.layers.1.2.bias", "layers.2._codebook.embed"}) {
    CAPTURE(name);
    const Tensor p = rvq.find(name);
    REQUIRE(p.grad().defined());
    const Tensor fd = numeric_grad(p, loss);
    CHECK(max_abs_diff(p.grad(), fd) < 1e-7);
  }
  // The condition carries the earlier layers' gradient: mlps.0 and layer 0's
  // codes take one through layers 1 and 2.
  CHECK(max_abs_diff(rvq.find("mlps.0.proj_in.weight").grad(),
                     zeros_like(rvq.find("mlps.0.proj_in.weight"))) > 0);
}

TEST_CASE("implicit neural codebook with Gumbel straight-through: the chosen per-token codes") {
  // The one-hot straight-through weights over each token's own codebook: in
  // value the chosen code (what a lookup gives), with a gradient to the
  // codes through the softmax.
  ResidualVQOptions o = qinco_options();
  o.layer.straight_through = true;
  o.layer.stochastic_sample_codes = true;
  o.layer.sample_codebook_temp = 0.5;
  Generator gen(23), data(24);
  ResidualVQ rvq(o, gen);
  rvq.to(DType::f64);
  const Tensor x = randn({2, 3, 4}, data, kF64);
  const QuantizeOutput out = rvq.forward(x);
  CHECK(max_abs_diff(out.quantized, rvq.get_output_from_indices(out.indices)) < 1e-12);
  sum(out.quantized * out.quantized).backward();
  const Tensor g = rvq.find("mlps.1.proj_in.weight").grad();
  REQUIRE(g.defined());
  CHECK(max_abs_diff(g, zeros_like(g)) > 0);
}

TEST_CASE("implicit neural codebook: refusals name the option") {
  Generator gen(11);
  ResidualVQOptions o = qinco_options();
  o.beam_size = 2;
  CHECK_THROWS_WITH_AS(ResidualVQ(o, gen), doctest::Contains("beam search"), std::invalid_argument);
  o = qinco_options();
  o.layer.ema_update = true;
  CHECK_THROWS_WITH_AS(ResidualVQ(o, gen), doctest::Contains("ema_update must be off"),
                       std::invalid_argument);
  o = qinco_options();
  o.layer.affine_param = true;
  CHECK_THROWS_WITH_AS(ResidualVQ(o, gen), doctest::Contains("affine_param"),
                       std::invalid_argument);
}

TEST_CASE("implicit neural codebook and vq_bridge on a device: no host reads, the CPU's numbers") {
  // A QINCo stack whose layers also share a bridge: both transforms in one
  // training step, on every test device; on sim bit for bit the CPU's.
  auto make = [](Generator& gen) {
    ResidualVQOptions o = qinco_options();
    o.layer.vq_bridge =
        std::make_shared<Sequential>(std::make_shared<Linear>(4, 4, gen), std::make_shared<Tanh>());
    return std::make_unique<ResidualVQ>(o, gen);
  };
  Generator data(21);
  const Tensor x = randn({2, 5, 4}, data);
  Generator g0(22);
  auto cpu = make(g0);
  Tensor xc = x.clone();
  xc.requires_grad_(true);
  const QuantizeOutput ref = cpu->forward(xc);
  (sum(ref.quantized * ref.quantized) + sum(ref.loss)).backward();
  for (const Device device : testing::test_devices()) {
    CAPTURE(device.str());
    Generator g(22);
    auto rvq = make(g);
    rvq->to(device);
    Tensor xd = x.to(device);
    xd.requires_grad_(true);
    QuantizeOutput out;
    {
      HostSyncGuard guard("a QINCo training step");
      out = rvq->forward(xd);
      (sum(out.quantized * out.quantized) + sum(out.loss)).backward();
    }
    if (!device.is_sim()) continue;  // a GPU sums in other orders
    CHECK(max_abs_diff(out.quantized.to(Device::cpu()), ref.quantized) == 0.0);
    CHECK(out.indices.to(Device::cpu()).to_vector<int64_t>() == ref.indices.to_vector<int64_t>());
    CHECK(max_abs_diff(xd.grad().to(Device::cpu()), xc.grad()) == 0.0);
    const auto pd = rvq->named_parameters(), pc = cpu->named_parameters();
    REQUIRE(pd.size() == pc.size());
    for (std::size_t i = 0; i < pc.size(); ++i) {
      CAPTURE(pc[i].first);
      REQUIRE(pd[i].second.grad().defined());
      CHECK(max_abs_diff(pd[i].second.grad().to(Device::cpu()), pc[i].second.grad()) == 0.0);
    }
  }
}
