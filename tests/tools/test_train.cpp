// The training pipeline's parts without the binary: config layers and the
// quantizer option table, code statistics, the data order, the model, and
// checkpoints.
#include <doctest/doctest.h>

#include <cmath>
#include <set>

#include "cli_runner.h"
#include "engine/factory.h"
#include "engine/io/safetensors.h"
#include "engine/ops/reduce.h"
#include "engine/random/sampling.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/metrics.h"
#include "train/progress.h"
#include "train/quantizer.h"
#include "train/quantizer_config.h"
#include "train/trainer.h"
#include "train/vqvae.h"

using namespace quanta;
using namespace quanta::train;
using nlohmann::json;
using quanta::test::contains;
using quanta::test::ScratchDir;

namespace {

std::string invalid(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("config layers merge key by key and validate") {
  const json defaults = default_config_json();
  const TrainConfig d = config_from_json(defaults);
  CHECK(d.epochs == 2);
  CHECK(d.steps == 0);
  CHECK(d.batch_size == 64);
  CHECK(d.quantizer["type"] == "none");
  CHECK(config_to_json(d) == defaults);

  json merged = merge_config(defaults, {{"steps", 10}, {"model", {{"dim", 4}}}});
  const TrainConfig c = config_from_json(merged);
  CHECK(c.steps == 10);
  CHECK(c.epochs == 0);  // steps given: epochs cleared
  CHECK(c.model.dim == 4);
  CHECK(c.model.hidden == 32);  // untouched sibling key kept

  // A later layer overrides an earlier one; a new quantizer type drops the
  // options of the old one.
  json q = merge_config(defaults, {{"quantizer", {{"type", "vq"}, {"codebook_size", 512}}}});
  q = merge_config(q, {{"quantizer", {{"decay", 0.9}}}});
  CHECK(q["quantizer"] == json{{"type", "vq"}, {"codebook_size", 512}, {"decay", 0.9}});
  q = merge_config(q, {{"quantizer", {{"type", "fsq"}, {"levels", {8, 5, 5, 5}}}}});
  CHECK(q["quantizer"] == json{{"type", "fsq"}, {"levels", {8, 5, 5, 5}}});
  CHECK_NOTHROW(config_from_json(q));

  CHECK(contains(invalid([&] { merge_config(defaults, {{"stepz", 1}}); }), "unknown key 'stepz'"));
  CHECK(contains(invalid([&] { merge_config(defaults, {{"steps", 3}, {"epochs", 2}}); }), "steps or epochs, not both"));
  CHECK(contains(invalid([&] { config_from_json(merge_config(defaults, {{"batch_size", "64"}})); }), "'batch_size' must be a positive integer, got \"64\""));
  CHECK(contains(invalid([&] { config_from_json(merge_config(defaults, {{"lr", 0}})); }), "'lr' must be a positive number"));
  CHECK(contains(invalid([&] {
          config_from_json(merge_config(defaults, {{"model", {{"depth", 3}}}}));
        }), "unknown key 'model.depth'"));
}

TEST_CASE("quantizer options: one table, typed, per quantizer type") {
  std::set<std::string> keys;
  for (const auto& o : quantizer_options()) {
    CHECK(keys.insert(o.key).second);
    CHECK_FALSE(o.types.empty());
  }
  for (const char* k : {"codebook_size", "levels", "threshold_ema_dead_code", "num_quantizers",
                        "codebook_dim", "use_cosine_sim", "commitment_weight",
                        "entropy_loss_weight", "decay", "kmeans_init"})
    CHECK(keys.count(k) == 1);
  CHECK(flag_name("threshold_ema_dead_code") == "threshold-ema-dead-code");

  CHECK_NOTHROW(validate_quantizer_config({{"type", "none"}}));
  CHECK_NOTHROW(validate_quantizer_config(
      {{"type", "rvq"}, {"codebook_size", 256}, {"num_quantizers", 4}, {"kmeans_init", true},
       {"threshold_ema_dead_code", 2}, {"commitment_weight", 0.25}}));
  CHECK_NOTHROW(validate_quantizer_config(
      {{"type", "lfq"}, {"codebook_size", 1024}, {"entropy_loss_weight", 0.1}}));
  CHECK(contains(invalid([] { validate_quantizer_config({{"type", "pq"}}); }), "unknown quantizer type 'pq'"));
  CHECK(contains(invalid([] { validate_quantizer_config({{"codebook_size", 2}}); }), "needs a string \"type\""));
  CHECK(contains(invalid([] { validate_quantizer_config({{"type", "vq"}, {"codebok_size", 2}}); }), "unknown quantizer option 'codebok_size'"));
  CHECK(contains(invalid([] { validate_quantizer_config({{"type", "fsq"}, {"codebook_size", 2}}); }), "'codebook_size' does not apply to quantizer 'fsq'"));
  CHECK(contains(invalid([] { validate_quantizer_config({{"type", "vq"}, {"codebook_size", 2.5}}); }), "must be an integer > 0, got 2.5"));
  CHECK(contains(invalid([] { validate_quantizer_config({{"type", "fsq"}, {"levels", {8, 0}}}); }), "'levels' must be a list of positive integers"));
  CHECK(contains(invalid([] { validate_quantizer_config({{"type", "vq"}, {"kmeans_init", 1}}); }), "'kmeans_init' must be true or false, got 1"));

  auto option = [](const std::string& key) {
    for (const auto& o : quantizer_options())
      if (o.key == key) return o;
    FAIL("no option " << key);
    return quantizer_options()[0];
  };
  CHECK(parse_option_value(option("levels"), "8,5,5,5") == json({8, 5, 5, 5}));
  CHECK(parse_option_value(option("codebook_size"), "512") == 512);
  CHECK(parse_option_value(option("decay"), "0.99") == 0.99);
  CHECK(parse_option_value(option("kmeans_init"), "false") == false);
  CHECK(contains(invalid([&] { parse_option_value(option("levels"), "8,,5"); }), "--levels: expected a list"));
  CHECK(contains(invalid([&] { parse_option_value(option("codebook_size"), "-3"); }), "--codebook-size: expected an integer, got '-3'"));
  CHECK(contains(invalid([&] { parse_option_value(option("decay"), "fast"); }), "--decay: expected a number"));
}

TEST_CASE("code counts give usage and perplexity per codebook") {
  CodeCounts one(4, 1);
  one.add(from_vector<int64_t>({0, 0, 1, 1}, {2, 2}));
  CHECK(one.usage() == doctest::Approx(0.5));
  CHECK(one.perplexity() == doctest::Approx(2.0));  // two codes, equally often
  const std::vector<double> t = one.totals();
  REQUIRE(t.size() == 4);
  CHECK(t[0] == 2);
  CHECK(t[1] == 2);
  CHECK(t[2] == 0);
  CHECK(t[3] == 0);
  CHECK_THROWS_WITH_AS(one.add(from_vector<int64_t>({4})), doctest::Contains("code index 4"),
                       std::invalid_argument);

  CodeCounts two(3, 2);  // indices [N, 2]: codebook 0 uses {0}, codebook 1 uses {0, 1, 2}
  two.add(from_vector<int64_t>({0, 0, 0, 1, 0, 2}, {3, 2}));
  CHECK(two.usage() == doctest::Approx((1.0 / 3 + 1.0) / 2));
  CHECK(two.perplexity() == doctest::Approx((1.0 + 3.0) / 2));
  CHECK(two.totals() == std::vector<double>{4, 1, 1});

  CodeCounts none(0, 1);
  none.add(zeros({0}, {.dtype = DType::i64}));
  CHECK(std::isnan(none.usage()));
  CHECK(std::isnan(none.perplexity()));
  CHECK(none.totals().empty());
}

TEST_CASE("batch_indices: each epoch a permutation, a pure function of seed and step") {
  const int64_t n = 10, b = 4;  // 3 batches per epoch: 4, 4, 2
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    std::vector<int64_t> seen;
    for (int64_t k = 0; k < 3; ++k) {
      const Tensor idx = batch_indices(7, epoch * 3 + k, n, b);
      CHECK(idx.numel() == (k < 2 ? 4 : 2));
      for (int64_t v : idx.to_vector<int64_t>()) seen.push_back(v);
    }
    std::sort(seen.begin(), seen.end());
    for (int64_t i = 0; i < n; ++i) CHECK(seen[i] == i);
  }
  CHECK(batch_indices(7, 4, n, b).to_vector<int64_t>() ==
        batch_indices(7, 4, n, b).to_vector<int64_t>());
  CHECK(batch_indices(7, 0, n, b).to_vector<int64_t>() !=
        batch_indices(7, 3, n, b).to_vector<int64_t>());  // a new order each epoch
  CHECK(batch_indices(7, 0, n, b).to_vector<int64_t>() !=
        batch_indices(8, 0, n, b).to_vector<int64_t>());
}

TEST_CASE("the VQ-VAE maps 28x28 images to 7x7 latents and back, with gradients") {
  Generator gen(3);
  VqVae model({.hidden = 8, .dim = 4}, make_quantizer({{"type", "none"}}, 4, 0), gen);
  Generator data(1);
  const Tensor x = rand({2, 1, 28, 28}, data);
  CHECK(model.encode(x).shape() == Shape{2, 4, 7, 7});
  VqVaeOutput out = model.run(x);
  CHECK(out.reconstruction.shape() == Shape{2, 1, 28, 28});
  for (float v : out.reconstruction.to_vector<float>()) CHECK((v > 0 && v < 1));
  CHECK(out.quantized.indices.numel() == 0);
  CHECK(out.quantized.loss.item() == 0.0);
  sum(out.reconstruction).backward();
  for (const auto& [name, p] : model.named_parameters()) {
    CAPTURE(name);
    CHECK(p.grad().defined());
  }
  CHECK(model.state_dict().size() == 14);  // 7 convolutions: weight + bias each
  CHECK(contains(invalid([&] { model.encode(zeros({2, 1, 14, 14})); }), "expected images [B, 1, 28, 28]"));
  CHECK(model.run(zeros({0, 1, 28, 28})).reconstruction.shape() == Shape{0, 1, 28, 28});

  NoQuantizer none;
  CHECK(none.codebook_size() == 0);
  CHECK(contains(invalid([&] { none.decode(zeros({1, 7, 7}, {.dtype = DType::i64})); }), "has no codes"));
  CHECK(contains(invalid([] { make_quantizer({{"type", "vq"}}, 4, 0); }), "'vq' is not available"));
}

TEST_CASE("checkpoints restore the model, optimizer and run state") {
  ScratchDir dir("ckpt");
  json cfg = merge_config(default_config_json(),
                          {{"steps", 5}, {"model", {{"hidden", 8}, {"dim", 4}}}, {"seed", 11}});
  Generator gen = Generator::named(11, "model");
  VqVae model({.hidden = 8, .dim = 4}, make_quantizer(cfg["quantizer"], 4, 11), gen);
  // Perturb the weights so a fresh init would not match by accident.
  for (const Tensor& p : model.parameters()) add_(p.detach(), full_like(p, 0.125));
  Adam opt(model.parameters(), {.lr = 1e-3});
  Generator data(2);
  sum(model.forward(rand({2, 1, 28, 28}, data))).backward();
  opt.step();

  const std::string path = dir.file("c.safetensors");
  save_checkpoint(path, model, &opt, {cfg, 5, 1, {{"seed", 11}}});
  const Checkpoint ck = load_checkpoint(path);
  CHECK(ck.info.step == 5);
  CHECK(ck.info.epoch == 1);
  CHECK(ck.info.config == cfg);
  CHECK(ck.info.rng["seed"] == 11);
  CHECK(find_tensor(ck.optimizer, "state.0.0.exp_avg") != nullptr);
  auto restored = restore_model(ck, path);
  const StateDict a = model.state_dict(), b = restored->state_dict();
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CAPTURE(a[i].first);
    CHECK(a[i].first == b[i].first);
    CHECK(a[i].second.to_vector<float>() == b[i].second.to_vector<float>());
  }
  CHECK_FALSE(restored->is_training());

  io::save_safetensors(dir.file("plain.safetensors"), {{"w", zeros({2})}});
  CHECK_THROWS_WITH_AS(load_checkpoint(dir.file("plain.safetensors")),
                       doctest::Contains("not a quanta training checkpoint"), std::runtime_error);
  CHECK(resume_conflict(cfg, merge_config(cfg, {{"steps", 50}})).empty());
  CHECK(contains(resume_conflict(cfg, merge_config(cfg, {{"lr", 0.1}})),
                 "lr: checkpoint 0.002, now 0.1"));
}

TEST_CASE("format_duration") {
  CHECK(format_duration(12.4) == "12s");
  CHECK(format_duration(135) == "2m15s");
  CHECK(format_duration(3720) == "1h02m");
  CHECK(format_duration(NAN) == "?");
}
