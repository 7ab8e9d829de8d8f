// DiVeQ (directional_reparam in VectorQuantize, diveq in ResidualVQ), the
// residual gradient fraction and what masked tokens output: the resolved
// defaults, the refusals, where the noise comes from, and the values the
// layers give against their definitions. quanta parity checks the numbers
// against vector-quantize-pytorch 1.32 (vq_diveq, rvq_q3_diveq_proj,
// rvq_q3_grad_frac, rvq_q2_masked_*, vq_masked_keep_input).
#include <doctest/doctest.h>

#include "quant/vq/directional_reparam.h"
#include "quant/vq/residual_vq.h"
#include "quant/vq/vector_quantize.h"
#include "quanta.h"
#include "vq_test_util.h"

using namespace quanta;
using namespace quanta::quant;
using quanta::testing::max_abs_diff;

namespace {

VectorQuantizeOptions diveq_options() {
  VectorQuantizeOptions o;
  o.dim = 4;
  o.codebook_size = 6;
  o.directional_reparam = true;
  o.directional_reparam_variance = 0.01;
  o.threshold_ema_dead_code = 0.5;  // required; one step cannot reach it
  return o;
}

ResidualVQOptions rvq_options(int64_t codebook_dim = 0) {
  ResidualVQOptions o;
  o.dim = 4;
  o.codebook_dim = codebook_dim;
  o.num_quantizers = 3;
  o.codebook_sizes = {6};
  return o;
}

}  // namespace

TEST_CASE("directional_reparam: learnable codes, no EMA, no rotation, no commitment loss") {
  Generator gen(1), data(2);
  VectorQuantize vq(diveq_options(), gen);
  CHECK(vq.learnable_codebook());
  CHECK_FALSE(vq.ema_update());
  CHECK_FALSE(vq.uses_rotation_trick());
  Tensor x = randn({2, 5, 4}, data);
  x.requires_grad_(true);
  const QuantizeOutput out = vq.forward(x);
  CHECK(out.term("commitment").item() == 0.0);
  CHECK(out.loss.item() == 0.0);
  // The value is x + n |q - x|: its distance to x is the code's.
  const Tensor codes = vq.get_output_from_indices(out.indices);
  const Tensor moved = norm(out.quantized - x.detach(), 2.0, {-1});
  CHECK(max_abs_diff(moved, norm(codes - x.detach(), 2.0, {-1})) < 1e-5);
  CHECK(max_abs_diff(out.quantized, codes) > 1e-4);  // the noise turned it off the code
  sum(out.quantized * out.quantized).backward();
  CHECK(x.grad().defined());
  REQUIRE(vq.codebook().embed().grad().defined());
  CHECK(max_abs_diff(vq.codebook().embed().grad(), zeros_like(vq.codebook().embed())) > 0);
  // Evaluation outputs the codes themselves.
  vq.eval();
  const QuantizeOutput e = vq.forward(x.detach());
  CHECK(max_abs_diff(e.quantized, vq.get_output_from_indices(e.indices)) == 0.0);
}

TEST_CASE("directional_reparam: the noise comes from the layer's step stream") {
  Generator g1(3), g2(3), data(4);
  VectorQuantize a(diveq_options(), g1), b(diveq_options(), g2);
  const Tensor x = randn({1, 6, 4}, data);
  // The same seed draws the same noise; the next forward draws other noise.
  const Tensor first = a.forward(x).quantized;
  CHECK(max_abs_diff(first, b.forward(x).quantized) == 0.0);
  CHECK(max_abs_diff(first, a.forward(x).quantized) > 0.0);
  // Pinned to a step, every forward of that step draws the same.
  a.pin_random_step(7);
  const Tensor pinned = a.forward(x).quantized;
  CHECK(max_abs_diff(pinned, a.forward(x).quantized) == 0.0);
  // A replaced source is what the layer draws from (quanta parity replays so).
  a.directional_noise = [](const Shape& s, const TensorOptions& o) { return zeros(s, o); };
  const QuantizeOutput quiet = a.forward(x);
  CHECK(max_abs_diff(quiet.quantized, a.get_output_from_indices(quiet.indices)) < 1e-6);
}

TEST_CASE("directional_reparam: refusals name the option") {
  Generator gen(5);
  VectorQuantizeOptions o = diveq_options();
  o.threshold_ema_dead_code = 0;
  CHECK_THROWS_WITH_AS(VectorQuantize(o, gen), doctest::Contains("threshold_ema_dead_code > 0"),
                       std::invalid_argument);
  o = diveq_options();
  o.rotation_trick = true;
  CHECK_THROWS_WITH_AS(VectorQuantize(o, gen), doctest::Contains("rotation_trick off"),
                       std::invalid_argument);
  o = diveq_options();
  o.directional_reparam_variance = -1;
  CHECK_THROWS_WITH_AS(VectorQuantize(o, gen), doctest::Contains("directional_reparam_variance"),
                       std::invalid_argument);
}

TEST_CASE("route_gradients_to_input = false: the output is the code, only codes learn") {
  Generator gen(6), data(7);
  VectorQuantizeOptions o;
  o.dim = 4;
  o.codebook_size = 6;
  o.learnable_codebook = true;
  o.ema_update = false;
  o.commitment_weight = 0;
  o.route_gradients_to_input = false;
  VectorQuantize vq(o, gen);
  Tensor x = randn({2, 3, 4}, data);
  x.requires_grad_(true);
  const QuantizeOutput out = vq.forward(x);
  CHECK(max_abs_diff(out.quantized, vq.get_output_from_indices(out.indices)) == 0.0);
  sum(out.quantized).backward();
  CHECK((!x.grad().defined() || max_abs_diff(x.grad(), zeros_like(x.detach())) == 0.0));
  REQUIRE(vq.codebook().embed().grad().defined());
}

TEST_CASE("ResidualVQ diveq: the summed codes reparameterised against the input, codes learn") {
  Generator g1(8), g2(8), data(9);
  ResidualVQOptions o = rvq_options(3);
  o.diveq = true;
  ResidualVQ rvq(o, g1);
  for (int64_t i = 0; i < 3; ++i) {
    CHECK(rvq.layer(i).learnable_codebook());
    CHECK_FALSE(rvq.layer(i).ema_update());
    CHECK(rvq.layer(i).options().commitment_weight == 0);
    CHECK_FALSE(rvq.layer(i).options().route_gradients_to_input);
  }
  Tensor x = randn({2, 4, 4}, data);
  x.requires_grad_(true);
  // Noise replaced by zeros: the value is then project_out of the summed codes.
  rvq.layer(0).directional_noise = [](const Shape& s, const TensorOptions& t) {
    return zeros(s, t);
  };
  const QuantizeOutput out = rvq.forward(x);
  CHECK(max_abs_diff(out.quantized, rvq.get_output_from_indices(out.indices)) < 1e-6);
  sum(out.quantized * out.quantized).backward();
  CHECK(max_abs_diff(x.grad(), zeros_like(x.detach())) > 0);
  // Every layer's codes take a gradient: the residual passes it all back.
  for (int64_t i = 0; i < 3; ++i) {
    REQUIRE(rvq.layer(i).codebook().embed().grad().defined());
    CHECK(max_abs_diff(rvq.layer(i).codebook().embed().grad(),
                       zeros_like(rvq.layer(i).codebook().embed())) > 0);
  }
  // Refusals: diveq trains by gradient.
  ResidualVQOptions bad = rvq_options();
  bad.diveq = true;
  bad.layer.ema_update = true;
  CHECK_THROWS_WITH_AS(ResidualVQ(bad, g2), doctest::Contains("ema_update must be off"),
                       std::invalid_argument);
  bad = rvq_options();
  bad.quant_grad_frac = 1.5;
  CHECK_THROWS_WITH_AS(ResidualVQ(bad, g2), doctest::Contains("quant_grad_frac must be in [0, 1]"),
                       std::invalid_argument);
}

TEST_CASE("quant_grad_frac: later layers' gradient reaches a layer's output in that fraction") {
  // Layer 1's commitment gradient reaches x through layer 0's output in the
  // fraction's share; the values never change.
  Generator data(10);
  const Tensor data_x = randn({2, 4, 4}, data);
  std::vector<Tensor> grads, values;
  for (double frac : {0.0, 0.5, 1.0}) {
    Generator gen(11);
    ResidualVQOptions o = rvq_options();
    o.num_quantizers = 2;  // two layers: the gradient is affine in the fraction
    o.quant_grad_frac = frac;
    o.layer.rotation_trick = false;  // straight-through: the algebra below holds
    ResidualVQ rvq(o, gen);
    Tensor x = data_x.clone();
    x.requires_grad_(true);
    const QuantizeOutput out = rvq.forward(x);
    sum(out.loss).backward();  // the commitment losses only
    grads.push_back(x.grad());
    values.push_back(out.quantized.detach());
  }
  CHECK(max_abs_diff(values[0], values[1]) == 0.0);
  CHECK(max_abs_diff(values[0], values[2]) == 0.0);
  // The gradient is affine in the fraction: g(0.5) = (g(0) + g(1)) / 2.
  CHECK(max_abs_diff(grads[1], (grads[0] + grads[2]) * 0.5) < 1e-6);
  CHECK(max_abs_diff(grads[0], grads[2]) > 1e-4);
}

TEST_CASE("masked tokens output zeros, or the input with return_zeros_for_masked_padding off") {
  Generator data(12);
  const Tensor x = randn({2, 3, 4}, data);
  const Tensor mask = to_dtype(from_vector<uint8_t>({1, 1, 0, 1, 0, 0}, {2, 3}), DType::boolean);
  const Tensor keep = unsqueeze(to_dtype(mask, DType::f32), -1);
  for (bool zeros_there : {true, false}) {
    CAPTURE(zeros_there);
    Generator g1(13), g2(13);
    VectorQuantizeOptions vo;
    vo.dim = 4;
    vo.codebook_dim = 3;  // projections: padding is set after project_out
    vo.codebook_size = 6;
    vo.return_zeros_for_masked_padding = zeros_there;
    VectorQuantize vq(vo, g1);
    ResidualVQOptions ro = rvq_options(3);
    ro.layer.return_zeros_for_masked_padding = zeros_there;
    ResidualVQ rvq(ro, g2);
    for (const Tensor& q : {vq.forward(x, mask).quantized, rvq.forward(x, mask).quantized}) {
      const Tensor pad = q * (1.0 - keep);
      CHECK(max_abs_diff(pad, zeros_there ? zeros_like(x) : x * (1.0 - keep)) == 0.0);
      CHECK(max_abs_diff(q * keep, zeros_like(x)) > 0);
    }
  }
}

TEST_CASE("manual_ema_update: the step moves the statistics, update_ema() the codes") {
  Generator g1(14), g2(14), data(15);
  VectorQuantizeOptions o;
  o.dim = 4;
  o.codebook_size = 6;
  VectorQuantize automatic(o, g1);
  o.manual_ema_update = true;
  VectorQuantize manual(o, g2);
  const Tensor x = randn({2, 5, 4}, data);
  const Tensor before = manual.codebook().embed().clone();
  automatic.forward(x);
  manual.forward(x);
  CHECK(max_abs_diff(manual.codebook().embed(), before) == 0.0);
  CHECK(max_abs_diff(manual.codebook().cluster_size(), automatic.codebook().cluster_size()) == 0.0);
  CHECK(max_abs_diff(manual.codebook().embed_avg(), automatic.codebook().embed_avg()) == 0.0);
  manual.update_ema();
  CHECK(max_abs_diff(manual.codebook().embed(), automatic.codebook().embed()) == 0.0);
  // A shared codebook ignores it: its codes follow once per forward, as the reference forces.
  Generator g3(16);
  ResidualVQOptions r;
  r.dim = 4;
  r.num_quantizers = 2;
  r.codebook_sizes = {6};
  r.shared_codebook = true;
  r.layer.manual_ema_update = true;
  ResidualVQ shared(r, g3);
  const Tensor codes = shared.layer(0).codebook().embed().clone();
  shared.forward(x);
  CHECK(max_abs_diff(shared.layer(0).codebook().embed(), codes) > 0);
}
