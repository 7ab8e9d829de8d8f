// rms_norm: op-harness rows (f64 finite differences, strided, zero-size,
// 16-bit, every device), transformers' LlamaRMSNorm in f32 and bf16, errors.
#include <doctest/doctest.h>

#include <cmath>

#include "engine/ops/harness.h"
#include "llm/ops/rms_norm.h"
#include "op_fixtures.h"
#include "support/gpu.h"
#include "support/relative_error.h"

using namespace quanta;
using namespace quanta::testing;

namespace {

// Plain loops: weight * x / sqrt(mean(x^2) + eps) over the last dim ((1 +
// weight) for Gemma's).
Tensor ref_rms_norm(const Inputs& xs, double eps, bool one_plus_weight = false) {
  const Tensor& x = xs[0];
  const int64_t n = x.shape().back(), rows = n ? x.numel() / n : 0;
  const std::vector<double> v = x.to_vector<double>(), w = xs[1].to_vector<double>();
  std::vector<double> y(v.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < n; ++j) ss += v[r * n + j] * v[r * n + j];
    const double scale = 1 / std::sqrt(ss / n + eps);
    for (int64_t j = 0; j < n; ++j)
      y[r * n + j] = (one_plus_weight ? 1 + w[j] : w[j]) * v[r * n + j] * scale;
  }
  return from_vector<double>(y, {static_cast<int64_t>(y.size())}).reshape(x.shape());
}

}  // namespace

TEST_CASE("rms_norm: op harness") {
  for (double eps : {1e-6, 0.5}) {
    OpCase c;
    c.name = "rms_norm eps " + std::to_string(eps);
    c.shapes = {{3, 4, 8}, {8}};
    c.zero_shapes = {{0, 8}, {8}};
    c.op = [eps](const Inputs& xs) { return llm::rms_norm(xs[0], xs[1], eps); };
    c.reference = [eps](const Inputs& xs) { return ref_rms_norm(xs, eps); };
    c.half = true;
    run_case(c);
  }
  // Enough rows that a GPU sums the weight's gradient in pieces of rows
  // (cuda::grid_pieces: from 64 rows), then the pieces in order.
  OpCase tall;
  tall.name = "rms_norm over 200 rows";
  tall.shapes = {{200, 6}, {6}};
  tall.op = [](const Inputs& xs) { return llm::rms_norm(xs[0], xs[1], 1e-6); };
  tall.reference = [](const Inputs& xs) { return ref_rms_norm(xs, 1e-6); };
  run_case(tall);
  // Gemma's (1 + weight), the weight's gradient and the input's through it.
  OpCase gemma;
  gemma.name = "rms_norm with 1 + weight";
  gemma.shapes = {{3, 4, 8}, {8}};
  gemma.zero_shapes = {{0, 8}, {8}};
  gemma.op = [](const Inputs& xs) {
    return llm::rms_norm(xs[0], xs[1], 1e-6, llm::RmsWeight::one_plus);
  };
  gemma.reference = [](const Inputs& xs) { return ref_rms_norm(xs, 1e-6, true); };
  gemma.half = true;
  run_case(gemma);
  // OLMo 2's: the weight applied before the one rounding.
  OpCase olmo = gemma;
  olmo.name = "rms_norm with the weight applied in f32";
  olmo.op = [](const Inputs& xs) {
    return llm::rms_norm(xs[0], xs[1], 1e-6, llm::RmsWeight::in_accumulation);
  };
  olmo.reference = [](const Inputs& xs) { return ref_rms_norm(xs, 1e-6); };
  run_case(olmo);
}

// GemmaRMSNorm: (x.float() * rsqrt(mean + eps) * (1 + w.float())).type_as(x);
// Olmo2RMSNorm: (w * x.float() * rsqrt(mean + eps)).to(x.dtype): one
// rounding at the end, where Llama's rounds the normalised value first.
TEST_CASE("rms_norm applied in f32: Gemma's and OLMo 2's one rounding in bf16") {
  for (const llm::RmsWeight how : {llm::RmsWeight::one_plus, llm::RmsWeight::in_accumulation})
    for (const Device dev : test_devices()) {
      const bool gemma = how == llm::RmsWeight::one_plus;
      INFO(dev.str(), gemma ? " gemma" : " olmo2");
      Generator gen(8);
      const Tensor x = (randn({37, 64}, gen) * 3.0).to(DType::bf16);
      const Tensor w = (randn({64}, gen) * 0.5).to(DType::bf16);
      const Tensor y = llm::rms_norm(x.to(dev), w.to(dev), 1e-6, how).to(Device::cpu());
      const Tensor xf = x.to(DType::f32), wf = w.to(DType::f32), factor = gemma ? wf + 1.0 : wf;
      const Tensor r = 1.0 / sqrt(mean(xf * xf, {1}, true) + 1e-6);
      const Tensor want = (xf * r * factor).to(DType::bf16);
      CHECK(y.dtype() == DType::bf16);
      // The f32 sum of squares may round differently: one bf16 step at most,
      // and equal bits nearly everywhere.
      CHECK(max_rel_diff(y, want) <= 0x1p-8);
      CHECK(mean(eq(y.to(DType::f32), want.to(DType::f32)).to(DType::f32)).item() > 0.99);
      // Llama's order of roundings would differ.
      const Tensor llama = ((xf * r).to(DType::bf16).to(DType::f32) * factor).to(DType::bf16);
      CHECK(mean(eq(llama.to(DType::f32), want.to(DType::f32)).to(DType::f32)).item() < 0.99);
    }
}

TEST_CASE("rms_norm: equals transformers' LlamaRMSNorm in f32 and bf16") {
  const auto& f = op_fixtures().at("rms_norm");
  const double eps = f.at("eps").get<double>();
  const Tensor y = llm::rms_norm(fixture_tensor(f.at("x")), fixture_tensor(f.at("weight")), eps);
  CHECK(max_rel_diff(y, fixture_tensor(f.at("y"))) < 1e-6);
  const Tensor yb = llm::rms_norm(fixture_tensor(f.at("x_bf16"), DType::bf16),
                                  fixture_tensor(f.at("weight_bf16"), DType::bf16), eps);
  CHECK(yb.dtype() == DType::bf16);
  // The same two roundings as transformers: equal to the bit but where the
  // f32 sum of squares rounds differently (then one bf16 step at most).
  CHECK(max_rel_diff(yb, fixture_tensor(f.at("y_bf16"))) <= 0x1p-8);
}

TEST_CASE("rms_norm: only the gradients taken, the input's added onto its other gradients") {
  // As a decoder uses it: x on the residual stream (read by the norm and by
  // the residual add) and a frozen weight (QLoRA). The input gradient adds
  // onto the residual's in the kernel; the frozen weight gets none; an
  // input that needs no gradient (the first norm over frozen embeddings)
  // gets none either. Against the same graph with a trained weight.
  for (const Device dev : test_devices())
    for (const DType dt : {DType::f32, DType::f64, DType::bf16}) {
      INFO(dev.str(), " ", dtype_name(dt));
      Generator gen(3);
      const Tensor x0 = randn({5, 16}, gen, {.dtype = dt}).to(dev);
      const Tensor w0 = (randn({16}, gen) + 1.0).to(dt).to(dev);
      const Tensor probe = randn({5, 16}, gen, {.dtype = dt}).to(dev);
      const auto grads = [&](bool train_w) {
        Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(train_w);
        const Tensor h = x * 2.0;
        // An op between the norm and the residual add, as attention is: the
        // add's gradient for h is then the engine's alone when the norm runs.
        Tensor y = llm::rms_norm(h, w, 1e-6) * 3.0;
        y = sum((y + h) * probe);
        y.backward();
        return std::pair<Tensor, Tensor>{x.grad(), w.grad()};
      };
      const auto [gx_frozen, gw_frozen] = grads(false);
      const auto [gx_trained, gw_trained] = grads(true);
      CHECK_FALSE(gw_frozen.defined());
      CHECK(gw_trained.defined());
      // The reference: the norm's input gradient alone (its input a leaf of
      // its own), plus the residual's, times h's 2.
      Tensor h = (x0 * 2.0).requires_grad_();
      sum(llm::rms_norm(h, w0, 1e-6) * 3.0 * probe).backward();
      const Tensor want = (h.grad() + probe) * 2.0;
      const double tol = dt == DType::bf16 ? 0x1p-6 : dt == DType::f32 ? 1e-6 : 1e-14;
      CHECK(max_rel_diff(gx_frozen, want) <= tol);
      CHECK(max_rel_diff(gx_trained, want) <= tol);
      // An input that needs no gradient (the first norm over frozen
      // embeddings): the weight's gradient alone, the same as with both.
      const Tensor w_only = w0.clone().requires_grad_(), w_both = w0.clone().requires_grad_();
      sum(llm::rms_norm(x0, w_only, 1e-6) * probe).backward();
      sum(llm::rms_norm(x0.clone().requires_grad_(), w_both, 1e-6) * probe).backward();
      REQUIRE(w_only.grad().defined());
      CHECK(max_rel_diff(w_only.grad(), w_both.grad()) == 0);
    }
}

TEST_CASE("rms_norm: clear errors") {
  const Tensor x = ones({2, 4});
  CHECK_THROWS_WITH(llm::rms_norm(x, ones({3})),
                    doctest::Contains("weight must be [4] (x's last dim), got [3]"));
  CHECK_THROWS_WITH(llm::rms_norm(x, ones({4}, {.dtype = DType::f64})),
                    doctest::Contains("x is f32 but weight is f64"));
  CHECK_THROWS_WITH(llm::rms_norm(ones({2, 4}, {.dtype = DType::i64}), ones({4})),
                    doctest::Contains("x has dtype i64"));
  CHECK_THROWS_WITH(llm::rms_norm(x, ones({4}), -1.0), doctest::Contains("eps must be"));
}
