// scaled_dot_product_attention: op-harness rows (plain, causal, grouped
// heads, KV-cache offsets, masks, more than one tile; f64 finite
// differences; every device), PyTorch's values and gradients, grouped heads
// equal to repeated heads, the same bits for any thread count, memory linear
// in the length on sim, errors.
#include <doctest/doctest.h>

#include <cmath>
#include <optional>

#include "engine/ops/harness.h"
#include "engine/precision.h"
#include "llm/ops/attention.h"
#include "op_fixtures.h"
#include "support/bf16_products.h"
#include "support/gpu.h"

using namespace quanta;
using namespace quanta::testing;

namespace {

// Plain loops over q [B, T, H, D], k, v [B, S, Hk, D]; mask [B or 1, H or 1,
// T, S] in f64 or undefined.
Tensor ref_attention(const Inputs& xs, bool causal, const Tensor& mask, double softcap = 0,
                     int64_t window = 0) {
  const Tensor &q = xs[0], &k = xs[1];
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t S = k.size(1), Hk = k.size(2);
  const std::vector<double> Q = q.to_vector<double>(), K = k.to_vector<double>(),
                            V = xs[2].to_vector<double>();
  const std::vector<double> M = mask.defined() ? mask.to_vector<double>() : std::vector<double>{};
  const double scale = 1 / std::sqrt(static_cast<double>(D));
  std::vector<double> out(Q.size(), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const int64_t hk = h / (H / Hk);
        std::vector<double> s(S, -INFINITY);
        double mx = -INFINITY;
        for (int64_t j = 0; j < S; ++j) {
          if (causal && j > i + S - T) continue;
          if (window > 0 && j <= i + S - T - window) continue;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d)
            dot += Q[((b * T + i) * H + h) * D + d] * K[((b * S + j) * Hk + hk) * D + d];
          s[j] = dot * scale;
          if (softcap > 0) s[j] = softcap * std::tanh(s[j] / softcap);
          if (mask.defined()) {
            const int64_t mb = mask.size(0) == 1 ? 0 : b, mh = mask.size(1) == 1 ? 0 : h;
            s[j] += M[((mb * mask.size(1) + mh) * T + i) * S + j];
          }
          mx = std::max(mx, s[j]);
        }
        if (mx == -INFINITY) continue;
        double z = 0;
        for (int64_t j = 0; j < S; ++j) z += std::exp(s[j] - mx);
        for (int64_t j = 0; j < S; ++j) {
          const double p = std::exp(s[j] - mx) / z;
          for (int64_t d = 0; d < D; ++d)
            out[((b * T + i) * H + h) * D + d] += p * V[((b * S + j) * Hk + hk) * D + d];
        }
      }
  return from_vector<double>(out, {static_cast<int64_t>(out.size())}).reshape(q.shape());
}

// An additive mask [B, 1, T, S]: -inf on a few keys of every row but the
// first key (so no row is wholly hidden), small values elsewhere.
Tensor padding_mask(int64_t B, int64_t T, int64_t S) {
  std::vector<double> m(static_cast<size_t>(B * T * S));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < T; ++i)
      for (int64_t j = 0; j < S; ++j)
        m[(b * T + i) * S + j] = (j > 0 && (j + b) % 3 == 0) ? -INFINITY : 0.1 * ((i + j) % 4);
  return from_vector<double>(m, {B, 1, T, S});
}

OpCase attention_case(const std::string& name, Shape q, Shape kv, bool causal,
                      const Tensor& mask = {}, double softcap = 0, int64_t window = 0) {
  OpCase c;
  c.name = name;
  c.shapes = {q, kv, kv};
  c.op = [causal, mask, softcap, window](const Inputs& xs) {
    llm::AttentionOptions o;
    o.causal = causal;
    o.softcap = softcap;
    o.window = window;
    if (mask.defined()) o.mask = mask.to(xs[0].device());
    return llm::scaled_dot_product_attention(xs[0], xs[1], xs[2], o);
  };
  c.reference = [causal, mask, softcap, window](const Inputs& xs) {
    return ref_attention(xs, causal, mask, softcap, window);
  };
  c.grad_tol = 1e-6;
  return c;
}

void harness_rows() {
  run_case(attention_case("sdpa plain", {2, 5, 2, 4}, {2, 6, 2, 4}, false));
  run_case(attention_case("sdpa causal gqa", {2, 7, 4, 4}, {2, 7, 2, 4}, true));
  run_case(attention_case("sdpa kv cache", {1, 3, 2, 4}, {1, 7, 1, 4}, true));
  run_case(attention_case("sdpa mask", {2, 4, 2, 4}, {2, 5, 2, 4}, false, padding_mask(2, 4, 5)));
  run_case(
      attention_case("sdpa causal mask", {2, 5, 2, 4}, {2, 5, 1, 4}, true, padding_mask(2, 5, 5)));
  // 2 images x 4 key heads: the one-pass backward (8 or more pairs).
  run_case(attention_case("sdpa one-pass backward", {2, 9, 8, 4}, {2, 9, 4, 4}, true,
                          padding_mask(2, 9, 9)));
  // Gemma 2's soft-capping, a cap inside the scores' spread so that tanh
  // bends them: forward and backward through the cap, under a mask, in both
  // backward passes.
  run_case(attention_case("sdpa softcap causal mask", {2, 5, 2, 4}, {2, 5, 1, 4}, true,
                          padding_mask(2, 5, 5), 0.6));
  run_case(attention_case("sdpa softcap one-pass backward", {2, 9, 8, 4}, {2, 9, 4, 4}, true,
                          Tensor(), 0.8));
  // Sliding windows: shorter than the queries (a KV cache offset too), with
  // a mask and soft-capping, in both backward passes; and past several
  // 128-key blocks, so that whole key blocks are skipped.
  run_case(attention_case("sdpa window 3", {2, 7, 4, 4}, {2, 7, 2, 4}, true, Tensor(), 0, 3));
  run_case(
      attention_case("sdpa window kv cache", {1, 3, 2, 4}, {1, 7, 1, 4}, true, Tensor(), 0, 2));
  run_case(attention_case("sdpa window mask softcap one-pass", {2, 9, 8, 4}, {2, 9, 4, 4}, true,
                          padding_mask(2, 9, 9), 0.8, 4));
  run_case(attention_case("sdpa window past blocks", {1, 300, 1, 2}, {1, 300, 1, 2}, true, Tensor(),
                          0, 130));
  // Past one 64-row tile in both directions, ragged last tiles.
  run_case(attention_case("sdpa tiles", {1, 70, 1, 3}, {1, 70, 1, 3}, true));
  OpCase zero = attention_case("sdpa zero-size", {2, 5, 2, 4}, {2, 6, 2, 4}, true);
  zero.zero_shapes = {{2, 0, 2, 4}, {2, 6, 2, 4}, {2, 6, 2, 4}};
  run_case(zero);
}

}  // namespace

TEST_CASE("attention: op harness") { harness_rows(); }

// CUDA has two attentions (llm/cuda/attention.cu): the whole-matrix
// products it runs by default, which the rows above reach on cuda:0, and
// the warp-per-row reference kernels, reached here.
TEST_CASE("attention: op harness on CUDA's reference kernels") {
  if (!have_gpu()) {
    MESSAGE("skipped: " << no_gpu_reason());
    return;
  }
  setenv("QUANTA_CUDA_ATTENTION", "reference", 1);
  harness_rows();
  unsetenv("QUANTA_CUDA_ATTENTION");
}

TEST_CASE("attention: equals PyTorch's values and gradients (causal GQA, KV-cache offset)") {
  for (const auto& c : op_fixtures().at("attention")) {
    INFO("case ", c.at("name").get<std::string>());
    const Tensor q = fixture_tensor(c.at("q")).requires_grad_(true);
    const Tensor k = fixture_tensor(c.at("k")).requires_grad_(true);
    const Tensor v = fixture_tensor(c.at("v")).requires_grad_(true);
    const Tensor out = llm::scaled_dot_product_attention(q, k, v, {.causal = true});
    CHECK(max_rel_diff(out, fixture_tensor(c.at("out"))) < 1e-5);
    out.backward(fixture_tensor(c.at("grad_out")));
    CHECK(max_rel_diff(q.grad(), fixture_tensor(c.at("grad_q"))) < 1e-5);
    CHECK(max_rel_diff(k.grad(), fixture_tensor(c.at("grad_k"))) < 1e-5);
    CHECK(max_rel_diff(v.grad(), fixture_tensor(c.at("grad_v"))) < 1e-5);
    const Tensor ob = llm::scaled_dot_product_attention(
        fixture_tensor(c.at("q"), DType::bf16), fixture_tensor(c.at("k"), DType::bf16),
        fixture_tensor(c.at("v"), DType::bf16), {.causal = true});
    CHECK(ob.dtype() == DType::bf16);
    // PyTorch's CPU kernel rounds its own intermediates: within a few bf16 steps.
    CHECK(max_rel_diff(ob, fixture_tensor(c.at("out_bf16"))) < 4 * 0x1p-8);
  }
}

TEST_CASE("attention: grouped heads equal repeated heads, and bits do not depend on threads") {
  // 4 images x 2 key heads: the one-pass backward; the harness rows cover both.
  const Tensor q = make_input({4, 80, 4, 8}, Domain::any, 1).to(DType::f32).requires_grad_(true);
  const Tensor k = make_input({4, 80, 2, 8}, Domain::any, 2).to(DType::f32).requires_grad_(true);
  const Tensor v = make_input({4, 80, 2, 8}, Domain::any, 3).to(DType::f32).requires_grad_(true);
  const Tensor g = make_input({4, 80, 4, 8}, Domain::any, 4).to(DType::f32);
  const auto run = [&](int threads) {
    const int before = num_threads();
    set_num_threads(threads);
    q.zero_grad(), k.zero_grad(), v.zero_grad();
    const Tensor out = llm::scaled_dot_product_attention(q, k, v, {.causal = true});
    out.backward(g);
    std::vector<std::vector<float>> r = {out.to_vector<float>(), q.grad().to_vector<float>(),
                                         k.grad().to_vector<float>(), v.grad().to_vector<float>()};
    set_num_threads(before);
    return r;
  };
  CHECK(run(1) == run(2));
  // Key head c serves query heads 2c and 2c + 1: the same as copies of it.
  const auto repeat_heads = [](const Tensor& t) {
    return reshape(expand(unsqueeze(t.detach(), 3), {4, 80, 2, 2, 8}), {4, 80, 4, 8});
  };
  const Tensor rk = repeat_heads(k), rv = repeat_heads(v);
  const Tensor grouped =
      llm::scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), {.causal = true});
  const Tensor copied = llm::scaled_dot_product_attention(q.detach(), rk, rv, {.causal = true});
  CHECK(max_rel_diff(grouped, copied) < 1e-6);
}

TEST_CASE("attention under MixedPrecision: bf16 products of its blocks, f32 softmax") {
  if (!bf16_products_or_skip("llm_bf16_products_forced")) return;
  // 256 queries of head_dim 64: full 128-wide blocks, products of 2^20
  // multiply-adds, which take bf16 operands under the guard.
  const Tensor q = make_input({1, 256, 2, 64}, Domain::any, 5).to(DType::f32).requires_grad_(true);
  const Tensor k = make_input({1, 256, 2, 64}, Domain::any, 6).to(DType::f32).requires_grad_(true);
  const Tensor v = make_input({1, 256, 2, 64}, Domain::any, 7).to(DType::f32).requires_grad_(true);
  const Tensor g = make_input({1, 256, 2, 64}, Domain::any, 8).to(DType::f32);
  const Tensor exact =
      llm::scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), {.causal = true});
  Tensor out;
  {
    const MixedPrecision mixed;
    out = llm::scaled_dot_product_attention(q, k, v, {.causal = true});
  }
  // bf16 keeps 8 bits of each operand: the output moves by about 2^-9 of
  // its scale, visibly but no more.
  CHECK(max_rel_diff(out, exact) > 1e-5);
  CHECK(max_rel_diff(out, exact) < 3e-2);
  // The backward runs in the forward's precision after the guard ended;
  // its gradients stay near the f32 ones.
  out.backward(g);
  const Tensor qe = q.detach().requires_grad_(true), ke = k.detach().requires_grad_(true),
               ve = v.detach().requires_grad_(true);
  llm::scaled_dot_product_attention(qe, ke, ve, {.causal = true}).backward(g);
  for (const auto& [mixed_grad, f32_grad] :
       {std::pair{q.grad(), qe.grad()}, std::pair{k.grad(), ke.grad()},
        std::pair{v.grad(), ve.grad()}}) {
    CHECK(max_rel_diff(mixed_grad, f32_grad) > 1e-5);
    CHECK(max_rel_diff(mixed_grad, f32_grad) < 5e-2);
  }
}

TEST_CASE("attention: memory linear in the length (sim's peak allocation)") {
  const Device dev = Device::sim(0);
  const auto peak = [&](int64_t T) {
    const TensorOptions f32{.dtype = DType::f32, .device = dev};
    const Tensor q = full({1, T, 2, 16}, 0.01, f32).requires_grad_(true);
    const Tensor k = full({1, T, 2, 16}, 0.02, f32).requires_grad_(true);
    const Tensor v = full({1, T, 2, 16}, 0.03, f32).requires_grad_(true);
    synchronize(dev);
    reset_device_stats(dev);
    const int64_t base = device_stats(dev).allocated_bytes;
    sum(llm::scaled_dot_product_attention(q, k, v, {.causal = true})).backward();
    synchronize(dev);
    return device_stats(dev).peak_allocated_bytes - base;
  };
  const int64_t small = peak(512), large = peak(2048);
  MESSAGE("attention fwd+bwd peak on sim: T=512 " << small << " B, T=2048 " << large << " B");
  // Linear: 4x the length costs about 4x; a T x T matrix per head would be 16x.
  CHECK(large <= 5 * small);
  CHECK(large < 2048 * 2048 * 4);  // not one f32 score matrix
}

TEST_CASE("attention: clear errors") {
  const Tensor q = ones({1, 3, 4, 8}), kv = ones({1, 3, 3, 8});
  CHECK_THROWS_WITH(llm::scaled_dot_product_attention(q, kv, kv),
                    doctest::Contains("q's 4 heads are not a multiple of k's 3"));
  CHECK_THROWS_WITH(llm::scaled_dot_product_attention(ones({3, 4, 8}), kv, kv),
                    doctest::Contains("q must be [batch, len, heads, head_dim], got [3, 4, 8]"));
  CHECK_THROWS_WITH(llm::scaled_dot_product_attention(q, ones({1, 3, 2, 8}), ones({1, 4, 2, 8})),
                    doctest::Contains("k [1, 3, 2, 8] and v [1, 4, 2, 8] differ"));
  CHECK_THROWS_WITH(llm::scaled_dot_product_attention(q, ones({1, 3, 2, 4}), ones({1, 3, 2, 4})),
                    doctest::Contains("disagree on batch or head_dim"));
  CHECK_THROWS_WITH(llm::scaled_dot_product_attention(q, ones({1, 3, 2, 8}, {.dtype = DType::f64}),
                                                      ones({1, 3, 2, 8}, {.dtype = DType::f64})),
                    doctest::Contains("q is f32 but k is f64"));
  llm::AttentionOptions o;
  o.mask = ones({2, 1, 3, 3});
  CHECK_THROWS_WITH(llm::scaled_dot_product_attention(q, ones({1, 3, 2, 8}), ones({1, 3, 2, 8}), o),
                    doctest::Contains("does not broadcast to [1, 4, 3, 3]"));
  o.mask = ones({3, 3}, {.dtype = DType::i64});
  CHECK_THROWS_WITH(llm::scaled_dot_product_attention(q, ones({1, 3, 2, 8}), ones({1, 3, 2, 8}), o),
                    doctest::Contains("mask has dtype i64"));
  llm::AttentionOptions windowed;
  windowed.window = 4;
  CHECK_THROWS_WITH(
      llm::scaled_dot_product_attention(q, ones({1, 3, 2, 8}), ones({1, 3, 2, 8}), windowed),
      doctest::Contains("window must be >= 0 (0: none) and needs causal, got 4 without causal"));
  llm::AttentionOptions capped;
  capped.softcap = -1;
  CHECK_THROWS_WITH(
      llm::scaled_dot_product_attention(q, ones({1, 3, 2, 8}), ones({1, 3, 2, 8}), capped),
      doctest::Contains("softcap must be finite and >= 0 (0: none), got -1"));
}
