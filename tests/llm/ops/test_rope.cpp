// Rotary embeddings: transformers' tables for every supported scaling kind,
// apply_rotary_pos_emb in f32 and bf16, op-harness rows (the rotation's
// gradient by finite differences, every device), errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "engine/ops/harness.h"
#include "engine/ops/join.h"
#include "engine/ops/view.h"
#include "llm/ops/rope.h"
#include "op_fixtures.h"
#include "support/gpu.h"

using namespace quanta;
using namespace quanta::testing;

namespace {

llm::RopeConfig config_of(const nlohmann::json& c) {
  const auto& p = c.at("rope_parameters");
  llm::RopeConfig cfg;
  cfg.theta = p.at("rope_theta").get<double>();
  cfg.head_dim = c.at("head_dim").get<int64_t>();
  cfg.max_position_embeddings = c.at("max_position_embeddings").get<int64_t>();
  cfg.scaling.type = p.at("rope_type").get<std::string>();
  if (p.contains("factor")) cfg.scaling.factor = p.at("factor").get<double>();
  if (p.contains("low_freq_factor")) cfg.scaling.low_freq_factor = p.at("low_freq_factor");
  if (p.contains("high_freq_factor")) cfg.scaling.high_freq_factor = p.at("high_freq_factor");
  if (p.contains("original_max_position_embeddings"))
    cfg.scaling.original_max_position_embeddings = p.at("original_max_position_embeddings");
  return cfg;
}

Tensor positions_of(const std::vector<int64_t>& p) {
  return from_vector<int64_t>(p, {1, static_cast<int64_t>(p.size())});
}

const std::vector<int64_t> kPositions = {0, 1, 4, 9, 30};

// Plain loops: the rotation of x [B, T, H, D] at kPositions (every batch row
// alike) by theta 10000's frequencies, in f64 from the f32 inverse frequencies.
Tensor ref_rope(const Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3), half = D / 2;
  const std::vector<float> inv =
      llm::rope_frequencies({.theta = 10000, .head_dim = D, .max_position_embeddings = 64})
          .inv_freq;
  const std::vector<double> v = x.to_vector<double>();
  std::vector<double> y(v.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < half; ++d) {
          const double angle = static_cast<double>(kPositions[t]) * inv[d];
          const int64_t at = ((b * T + t) * H + h) * D + d;
          const double a = v[at], c = v[at + half];
          y[at] = a * std::cos(angle) - c * std::sin(angle);
          y[at + half] = c * std::cos(angle) + a * std::sin(angle);
        }
  return from_vector<double>(y, {static_cast<int64_t>(y.size())}).reshape(x.shape());
}

Tensor rope_at_positions(const Tensor& x) {
  const llm::RopeFrequencies f =
      llm::rope_frequencies({.theta = 10000, .head_dim = x.size(3), .max_position_embeddings = 64});
  return llm::apply_rope(x,
                         llm::rope_tables(f, positions_of(kPositions).to(x.device()), x.dtype()));
}

}  // namespace

TEST_CASE("rope: transformers' tables for default, theta, linear, dynamic and llama3") {
  for (const auto& c : op_fixtures().at("rope")) {
    const std::string name = c.at("name").get<std::string>();
    INFO("case ", name);
    const std::vector<int64_t> pos = c.at("positions").get<std::vector<int64_t>>();
    const llm::RopeFrequencies f = llm::rope_frequencies(config_of(c), pos.back() + 1);
    const std::vector<float> want = c.at("inv_freq").get<std::vector<float>>();
    REQUIRE(f.inv_freq.size() == want.size());
    for (size_t i = 0; i < want.size(); ++i)
      CHECK_MESSAGE(std::abs(f.inv_freq[i] - want[i]) <= 2e-7f * want[i], "inv_freq[" << i << "]");
    CHECK(f.attention_scaling == c.at("attention_scaling").get<double>());
    const llm::RopeTables t = llm::rope_tables(f, positions_of(pos), DType::f32);
    CHECK(max_rel_diff(t.cos, fixture_tensor(c.at("cos"))) < 1e-6);
    CHECK(max_rel_diff(t.sin, fixture_tensor(c.at("sin"))) < 1e-6);
  }
}

TEST_CASE("rope: equals transformers' apply_rotary_pos_emb in f32 and bf16") {
  const auto& f = op_fixtures().at("apply_rope");
  const std::vector<int64_t> pos = f.at("positions").get<std::vector<int64_t>>();
  const llm::RopeFrequencies freq = llm::rope_frequencies(
      {.theta = f.at("theta").get<double>(), .head_dim = f.at("head_dim").get<int64_t>()});
  for (DType dt : {DType::f32, DType::bf16}) {
    const std::string tag = dt == DType::bf16 ? "_bf16" : "";
    INFO("dtype ", dtype_name(dt));
    const Tensor q = fixture_tensor(f.at("q" + tag), dt);
    const Tensor out = llm::apply_rope(q, llm::rope_tables(freq, positions_of(pos), dt));
    CHECK(out.dtype() == dt);
    CHECK(max_rel_diff(out, fixture_tensor(f.at("out" + tag))) <
          (dt == DType::bf16 ? 0x1p-8 : 1e-5));
  }
}

TEST_CASE("rope: op harness") {
  OpCase c;
  c.name = "apply_rope";
  c.shapes = {{2, 5, 3, 8}};
  c.zero_shapes = {{0, 5, 3, 8}};
  c.op = [](const Inputs& xs) { return rope_at_positions(xs[0]); };
  c.reference = [](const Inputs& xs) { return ref_rope(xs[0]); };
  run_case(c);
}

// Phi-3.5's and Phi-4-mini's longrope: each frequency divided by its short
// factor up to the original length, by its long factor past it, cos and sin
// scaled by sqrt(1 + ln factor / ln original) (transformers'
// _compute_longrope_parameters; the tiny phi3_longrope model checks the
// whole against transformers' logits).
TEST_CASE("rope: longrope's short and long factors and its attention factor") {
  llm::RopeConfig cfg{.theta = 10000, .head_dim = 6, .max_position_embeddings = 128};
  cfg.scaling.type = "longrope";
  cfg.scaling.factor = 0;  // derived: 128 / 8
  cfg.scaling.original_max_position_embeddings = 8;
  cfg.scaling.short_factor = {1.0, 1.5, 2.0};
  cfg.scaling.long_factor = {1.0, 4.0, 16.0};
  const std::vector<float> plain = llm::rope_frequencies({.theta = 10000, .head_dim = 6}).inv_freq;
  for (const int64_t len : {0, 8, 9, 100}) {
    INFO("seq_len ", len);
    const llm::RopeFrequencies f = llm::rope_frequencies(cfg, len);
    const std::vector<double>& ext = len > 8 ? cfg.scaling.long_factor : cfg.scaling.short_factor;
    REQUIRE(f.inv_freq.size() == 3);
    for (size_t i = 0; i < 3; ++i)
      CHECK(f.inv_freq[i] == doctest::Approx(plain[i] / ext[i]).epsilon(1e-6));
    CHECK(f.attention_scaling == doctest::Approx(std::sqrt(1 + std::log(16.0) / std::log(8.0))));
  }
  cfg.scaling.attention_factor = 1.25;  // given: taken as it is
  CHECK(llm::rope_frequencies(cfg, 4).attention_scaling == 1.25);
  cfg.scaling.attention_factor = 0;
  cfg.scaling.factor = 1;  // no extension: no scaling
  CHECK(llm::rope_frequencies(cfg, 4).attention_scaling == 1.0);
  cfg.scaling.long_factor = {1.0, 2.0};
  CHECK_THROWS_WITH(llm::rope_frequencies(cfg, 4),
                    doctest::Contains("longrope's long_factor has 2 values, the rotated head_dim "
                                      "6 needs 3"));
}

// YaRN (Qwen2.5's and Qwen3's long contexts, OLMo 3, DeepSeek): each
// frequency blends itself and itself / factor by a ramp between the
// dimensions turning beta_fast and beta_slow times over the original length
// (transformers' _compute_yarn_parameters, here in double; the tiny
// qwen3_yarn model checks the whole against transformers' logits).
TEST_CASE("rope: yarn's blend of interpolated and kept frequencies, its attention factor") {
  const auto reference = [](const llm::RopeConfig& c) {
    const llm::RopeScaling& s = c.scaling;
    const double dim = double(c.head_dim), orig = double(s.original_max_position_embeddings);
    const auto correction = [&](double rot) {
      return dim * std::log(orig / (rot * 2 * M_PI)) / (2 * std::log(c.theta));
    };
    double low = correction(s.beta_fast > 0 ? s.beta_fast : 32);
    double high = correction(s.beta_slow > 0 ? s.beta_slow : 1);
    if (s.truncate) low = std::floor(low), high = std::ceil(high);
    low = std::max(low, 0.0), high = std::min(high, dim - 1);
    if (low == high) high += 0.001;
    std::vector<double> out;
    for (int64_t i = 0; i < c.head_dim / 2; ++i) {
      const double kept = std::pow(c.theta, -2.0 * double(i) / dim);
      const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
      out.push_back(kept / s.factor * ramp + kept * (1 - ramp));
    }
    return out;
  };
  llm::RopeConfig cfg{.theta = 10000, .head_dim = 16, .max_position_embeddings = 128};
  cfg.scaling.type = "yarn";
  cfg.scaling.factor = 4;
  cfg.scaling.original_max_position_embeddings = 32;
  const auto check = [&](double attention) {
    const llm::RopeFrequencies f = llm::rope_frequencies(cfg, 100);
    const std::vector<double> want = reference(cfg);
    REQUIRE(f.inv_freq.size() == want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      INFO("frequency ", i);
      CHECK(f.inv_freq[i] == doctest::Approx(want[i]).epsilon(1e-6));
    }
    CHECK(f.attention_scaling == doctest::Approx(attention).epsilon(1e-12));
  };
  SUBCASE("the defaults: beta 32 and 1, bounds rounded outwards, 0.1 ln factor + 1") {
    check(0.1 * std::log(4.0) + 1);
    // Kept at the high frequencies, divided by 4 at the low ones, between
    // in the ramp (dimensions 0..2 here).
    const llm::RopeFrequencies f = llm::rope_frequencies(cfg);
    const std::vector<float> plain =
        llm::rope_frequencies({.theta = 10000, .head_dim = 16}).inv_freq;
    CHECK(f.inv_freq[0] == plain[0]);
    CHECK(f.inv_freq[7] == doctest::Approx(plain[7] / 4).epsilon(1e-6));
    CHECK(f.inv_freq[1] < plain[1]);
    CHECK(f.inv_freq[1] > plain[1] / 4);
  }
  SUBCASE("betas, bounds not rounded") {
    cfg.scaling.beta_fast = 8, cfg.scaling.beta_slow = 0.5, cfg.scaling.truncate = false;
    check(0.1 * std::log(4.0) + 1);
  }
  SUBCASE("DeepSeek's mscale pair, a given attention factor, a derived factor") {
    cfg.scaling.mscale = 0.707, cfg.scaling.mscale_all_dim = 0.707;
    check(1.0);
    cfg.scaling.mscale_all_dim = 1;
    check((0.1 * 0.707 * std::log(4.0) + 1) / (0.1 * std::log(4.0) + 1));
    cfg.scaling.attention_factor = 1.5;
    check(1.5);
    cfg.scaling.attention_factor = 0, cfg.scaling.mscale = 0;
    cfg.scaling.factor = 0;  // 128 / 32
    const llm::RopeFrequencies f = llm::rope_frequencies(cfg);
    CHECK(f.attention_scaling == doctest::Approx(0.1 * std::log(4.0) + 1));
  }
  SUBCASE("no original length") {
    cfg.scaling.original_max_position_embeddings = 0;
    CHECK_THROWS_WITH(llm::rope_frequencies(cfg),
                      doctest::Contains("yarn needs original_max_position_embeddings > 0"));
  }
}

// Partial rotary (Phi-4-mini): tables of fewer frequencies than head_dim / 2
// rotate the first values of each head and pass the rest through; the
// rotation's gradient by finite differences.
TEST_CASE("rope: partial rotary, the rest of each head passed through") {
  OpCase c;
  c.name = "apply_rope_partial";
  c.shapes = {{2, 5, 3, 12}};
  c.op = [](const Inputs& xs) {
    const llm::RopeFrequencies f =
        llm::rope_frequencies({.theta = 10000, .head_dim = 8, .max_position_embeddings = 64});
    return llm::apply_rope(
        xs[0], llm::rope_tables(f, positions_of(kPositions).to(xs[0].device()), xs[0].dtype()));
  };
  c.reference = [](const Inputs& xs) {
    const Tensor x = xs[0];
    return cat({ref_rope(slice(x, 3, 0, 8).contiguous()), slice(x, 3, 8, 12)}, 3);
  };
  run_case(c);
}

// Tables of one sequence ([1, T, D / 2]) serve every row of a batch as
// they are (the kernel reads row r's angles at r % T); tables a row ([B, T,
// D / 2], packed sequences' positions) give each row its own: both against
// each row rotated alone, forward and backward, on every device.
TEST_CASE("rope: shared and per-row tables, each row as if rotated alone") {
  const llm::RopeFrequencies f =
      llm::rope_frequencies({.theta = 10000, .head_dim = 8, .max_position_embeddings = 64});
  const std::vector<std::vector<int64_t>> rows = {
      {0, 1, 2, 3, 4}, {7, 2, 9, 0, 31}, {3, 3, 5, 6, 1}};
  Generator gen(11);
  for (const Device& device : cpu_and_test_devices()) {
    INFO("device ", device.str());
    const Tensor x = randn({3, 5, 2, 8}, gen, {.dtype = DType::f64}).to(device);
    for (bool shared : {true, false}) {
      INFO("shared tables: ", shared);
      std::vector<int64_t> all;
      for (size_t b = 0; b < rows.size(); ++b)
        all.insert(all.end(), rows[shared ? 0 : b].begin(), rows[shared ? 0 : b].end());
      const Tensor positions = shared ? positions_of(rows[0]) : from_vector<int64_t>(all, {3, 5});
      const Tensor xg = x.detach().requires_grad_(true);
      const Tensor y = llm::apply_rope(xg, llm::rope_tables(f, positions.to(device), DType::f64));
      const Tensor gy = randn(y.shape(), gen, {.dtype = DType::f64}).to(device);
      sum(y * gy).backward();
      for (int64_t b = 0; b < 3; ++b) {
        const Tensor xb = slice(x, 0, b, b + 1).contiguous().detach().requires_grad_(true);
        const Tensor yb = llm::apply_rope(
            xb, llm::rope_tables(f, positions_of(rows[shared ? 0 : b]).to(device), DType::f64));
        sum(yb * slice(gy, 0, b, b + 1)).backward();
        CHECK(max_rel_diff(slice(y, 0, b, b + 1), yb) == 0.0);
        CHECK(max_rel_diff(slice(xg.grad(), 0, b, b + 1), xb.grad()) == 0.0);
      }
    }
  }
}

// A step's tables of positions start .. start + T - 1 are rows of one shared
// table a frequency set, dtype and device: the values rope_tables gives
// those positions, bit for bit, whatever length the shared table grew to.
TEST_CASE("rope: sequence tables are rows of one shared table, the values of rope_tables") {
  const llm::RopeFrequencies f = llm::rope_frequencies(
      {.theta = 5000, .head_dim = 6, .max_position_embeddings = 64});  // unlike other tests'
  for (const Device& device : cpu_and_test_devices()) {
    for (const DType dt : {DType::f32, DType::f64, DType::bf16}) {
      INFO(device.str(), " ", dtype_name(dt));
      // Grown from 5 rows, then to 20, then read in the middle and empty.
      for (const auto& [start, tokens] : std::vector<std::pair<int64_t, int64_t>>{
               {0, 5}, {0, 3}, {4, 16}, {7, 3}, {2, 0}, {0, 5}}) {
        INFO("start ", start, ", tokens ", tokens);
        const llm::RopeTables t = llm::sequence_rope_tables(f, start, tokens, dt, device);
        std::vector<int64_t> p(static_cast<size_t>(tokens));
        for (int64_t i = 0; i < tokens; ++i) p[i] = start + i;
        const llm::RopeTables want = llm::rope_tables(f, positions_of(p).to(device), dt);
        REQUIRE(t.cos.shape() == want.cos.shape());
        CHECK(t.cos.dtype() == want.cos.dtype());
        CHECK(t.cos.is_contiguous());
        CHECK(max_rel_diff(t.cos, want.cos) == 0.0);
        CHECK(max_rel_diff(t.sin, want.sin) == 0.0);
      }
      // Asked again, the same storage: nothing made.
      const llm::RopeTables again = llm::sequence_rope_tables(f, 3, 4, dt, device);
      CHECK(again.cos.storage() == llm::sequence_rope_tables(f, 0, 9, dt, device).cos.storage());
      CHECK_THROWS_WITH_AS(mul_(again.sin, 2.0), doctest::Contains("shared constant"),
                           std::invalid_argument);
      // An older, shorter table outlives the longer one made after it (a
      // captured step may still read it), with its values.
      const llm::RopeTables older = llm::sequence_rope_tables(f, 0, 30, dt, device);
      const Tensor older_values = older.cos.to(Device::cpu()).clone();
      const llm::RopeTables longer = llm::sequence_rope_tables(f, 0, 200, dt, device);
      CHECK(longer.cos.storage() != older.cos.storage());
      CHECK(older.cos.storage().use_count() > 1);  // kept, not only by this handle
      CHECK(max_rel_diff(older.cos, older_values) == 0.0);
      CHECK(max_rel_diff(slice(longer.cos, 1, 0, 30), older_values) == 0.0);
    }
  }
  // Past 16384 positions: made for the call, the same values, not kept.
  const llm::RopeTables far = llm::sequence_rope_tables(f, 16380, 10, DType::f32, Device::cpu());
  const llm::RopeTables far_again =
      llm::sequence_rope_tables(f, 16380, 10, DType::f32, Device::cpu());
  CHECK(far.cos.storage() != far_again.cos.storage());
  std::vector<int64_t> p(10);
  for (int64_t i = 0; i < 10; ++i) p[i] = 16380 + i;
  CHECK(max_rel_diff(far.sin, llm::rope_tables(f, positions_of(p), DType::f32).sin) == 0.0);
  CHECK_THROWS_WITH_AS(
      llm::sequence_rope_tables(f, -1, 3, DType::f32, Device::cpu()),
      doctest::Contains("[rope] positions start .. start + tokens need start >= 0"),
      std::invalid_argument);
}

TEST_CASE("rope: clear errors") {
  llm::RopeConfig cfg{.theta = 10000, .head_dim = 8, .max_position_embeddings = 64};
  cfg.scaling.type = "mrope";
  CHECK_THROWS_WITH(llm::rope_frequencies(cfg),
                    doctest::Contains("rope_scaling type 'mrope' is not supported"));
  cfg.scaling.type = "llama3";
  cfg.scaling.factor = 8;
  CHECK_THROWS_WITH(llm::rope_frequencies(cfg),
                    doctest::Contains("original_max_position_embeddings"));
  CHECK_THROWS_WITH(llm::rope_frequencies({.theta = 10000, .head_dim = 7}),
                    doctest::Contains("head_dim must be even"));
  CHECK_THROWS_WITH(llm::rope_frequencies({.theta = -1, .head_dim = 8}),
                    doctest::Contains("rope_theta must be finite and > 0"));
  const llm::RopeFrequencies f = llm::rope_frequencies({.theta = 10000, .head_dim = 8});
  const llm::RopeTables t = llm::rope_tables(f, positions_of({0, 1, 2}), DType::f32);
  CHECK_THROWS_WITH(llm::apply_rope(ones({1, 4, 2, 8}), t), doctest::Contains("cos must be"));
  CHECK_THROWS_WITH(llm::apply_rope(ones({1, 3, 2, 8}, {.dtype = DType::f64}), t),
                    doctest::Contains("needs f64 tables"));
  CHECK_THROWS_WITH(llm::rope_tables(f, ones({1, 3}), DType::f32),
                    doctest::Contains("positions must be i64 [batch, tokens]"));
}
