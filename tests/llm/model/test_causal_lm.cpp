// CausalLM against transformers on tiny random models (tests/data/llm,
// made by make_tiny_models.py): logits, loss and greedy generation on the
// CPU and sim, for GQA and plain heads, tied and untied embeddings, Llama 3
// RoPE scaling, bf16, Qwen2's biases, a sharded Mistral folder and Qwen3's
// per-head q and k norms. Also the
// KV cache against a full forward, the chunked loss against the plain one,
// a directional finite difference through the whole f64 model, save and
// reload, and the errors a bad folder or config gives.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "../ops/op_fixtures.h"
#include "engine/factory.h"
#include "engine/io/safetensors.h"
#include "engine/random/sampling.h"
#include "llm/data/lm_examples.h"
#include "llm/model/causal_lm.h"
#include "llm/model/generate.h"
#include "llm/model/lm_loss.h"
#include "llm/model/model_folder.h"
#include "llm/model/weight_names.h"
#include "support/gpu.h"
#include "support/temp_dir.h"
#include "support/test_data.h"

using namespace quanta;
using namespace quanta::testing;
namespace fs = std::filesystem;

namespace {

std::string data_dir() { return quanta::testing::test_data("llm"); }

const std::vector<std::string> kModels = {
    "llama_gqa",        "llama_tied_llama3", "llama_bf16",          "qwen2_bias",
    "mistral_sharded",  "qwen3_qk_norm",     "qwen3_bf16",          "gemma_geglu",
    "gemma2_softcap",   "gemma2_bf16",       "mistral_window",      "qwen2_window",
    "gemma3_text",      "gemma3_bf16",       "gemma3_image_text",   "phi3_fused",
    "phi3_longrope",    "olmo2_post_norms",  "olmo2_bf16",          "qwen3_yarn",
    "smollm3_nope",     "olmo3_window",      "granite_multipliers", "granite_bf16",
    "ministral_window", "exaone4_window"};

const Tensor& expected(const io::SafetensorsFile& f, const std::string& name) {
  for (const auto& [n, t] : f.tensors)
    if (n == name) return t;
  FAIL("expected file lacks " << name);
  static Tensor none;
  return none;
}

std::vector<int64_t> ids_of(const Tensor& t) { return t.to(DType::i64).to_vector<int64_t>(); }

// A small f64 model with every feature on: GQA, biases, untied, llama3 RoPE.
llm::DecoderConfig tiny_config(DType dtype) {
  llm::DecoderConfig c;
  c.vocab_size = 11, c.hidden_size = 8, c.intermediate_size = 12, c.num_hidden_layers = 2;
  c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 4;
  c.max_position_embeddings = 64, c.rms_norm_eps = 1e-5, c.dtype = dtype;
  c.attention_bias = true, c.qkv_bias = true, c.o_bias = true;
  c.rope = {.theta = 10000, .head_dim = 4, .max_position_embeddings = 64};
  return c;
}

// A config.json of `type` with 4 heads, vocabulary 10, intermediate size 16
// and 64 positions, `extra` (", \"key\": value" pairs) added, parsed as
// "cfg.json".
llm::DecoderConfig small_config(const std::string& type, int64_t hidden, int64_t layers,
                                const std::string& extra) {
  return llm::parse_decoder_config(
      R"({"model_type": ")" + type + R"(", "vocab_size": 10, "hidden_size": )" +
          std::to_string(hidden) + R"(, "intermediate_size": 16, "num_hidden_layers": )" +
          std::to_string(layers) + R"(, "num_attention_heads": 4, "max_position_embeddings": 64)" +
          extra + "}",
      "cfg.json");
}

}  // namespace

TEST_CASE("CausalLM: logits, loss and greedy tokens equal transformers' on cpu, sim and cuda") {
  for (const std::string& name : kModels) {
    INFO("model ", name);
    const io::SafetensorsFile want =
        io::load_safetensors(data_dir() + "/expected/" + name + ".safetensors");
    const bool bf16 = name.size() > 5 && name.compare(name.size() - 5, 5, "_bf16") == 0;
    const std::vector<Device> devices = cpu_and_test_devices();  // sim, and cuda on a GPU
    for (const Device dev : devices) {
      INFO("device ", dev.str());
      auto model = llm::load_causal_lm(data_dir() + "/models/" + name, dev);
      CHECK(model->config().dtype == (bf16 ? DType::bf16 : DType::f32));
      NoGradGuard no_grad;
      const Tensor ids = expected(want, "input_ids");
      const Tensor logits = model->logits(ids.to(dev)).to(Device::cpu());
      const double err = max_rel_diff(logits.to(DType::f32), expected(want, "logits"));
      MESSAGE(name << " on " << dev.str() << ": logits max |diff| / max |logit| = " << err);
      // f32: summation order only. bf16: transformers rounds the same
      // intermediates; a different order of f32 sums can flip a rounding.
      // Gemma 2's eager attention also rounds each score to bf16 five times
      // before the softmax (product, scale, / cap, tanh, * cap) where
      // quanta's stays in f32: transformers' own bf16 logits differ from its
      // f32 compute over the same weights by 3.0e-2 there (1.2e-2 for
      // qwen3_bf16, 1.3e-2 for llama_bf16; measured 2026-12-02).
      CHECK(err < (name == "gemma2_bf16" ? 4e-2 : bf16 ? 2e-2 : 1e-5));
      const Tensor loss = llm::causal_lm_loss(logits, ids);
      const double want_loss = expected(want, "loss").to_vector<double>()[0];
      CHECK(std::abs(loss.to_vector<double>()[0] - want_loss) < (bf16 ? 1e-2 : 1e-5) * want_loss);
      const std::vector<int64_t> got =
          llm::generate(*model, ids_of(expected(want, "prompt")), {.max_new_tokens = 8});
      const std::vector<int64_t> generated = ids_of(expected(want, "generated"));
      if (name != "olmo2_bf16") {
        CHECK(got == generated);
        continue;
      }
      // transformers' own bf16 scores tie exactly at the fifth new token
      // (tokens 59 and 11 both 2.4531; its argmax takes the first, 11):
      // either is greedy's answer, and the rest follows from it.
      REQUIRE(got.size() == 8);
      CHECK(std::vector<int64_t>(got.begin(), got.begin() + 4) ==
            std::vector<int64_t>(generated.begin(), generated.begin() + 4));
      CHECK((got[4] == 59 || got[4] == 11));
    }
  }
}

// Gemma 3's image-text folder: its decoder computes as transformers'
// Gemma3ForConditionalGeneration does on text (the parity above), read from
// either layout, named as transformers' module tree names it, and written
// back whole: the vision tower carried through as stored.
TEST_CASE("CausalLM: an image-text Gemma 3 folder, both layouts, its vision tower kept") {
  const std::string dir = data_dir() + "/models/gemma3_image_text";
  auto model = llm::load_causal_lm(dir);
  const llm::DecoderConfig& c = model->config();
  CHECK(model->layer_names().front() == "model.language_model.layers.0");
  CHECK(model->embed_tokens_name() == "model.language_model.embed_tokens");
  const StateDict stored = llm::read_model_weights(dir);
  int64_t vision = 0;
  for (const auto& [name, t] : stored) {
    const bool outside =
        name.starts_with("vision_tower.") || name.starts_with("multi_modal_projector.");
    vision += outside;
    CHECK(llm::decoder_weight_name(c, name).has_value() == !outside);
    CHECK((outside || name.starts_with("language_model.model.")));  // the hub's layout
  }
  CHECK(vision > 0);
  CHECK(llm::decoder_weight_name(c, "model.vision_tower.x") == std::nullopt);
  CHECK(llm::decoder_weight_name(c, "language_model.lm_head.weight") == "lm_head.weight");
  CHECK(llm::stored_weight_name(c, "lm_head.weight") == "language_model.lm_head.weight");
  NoGradGuard no_grad;
  const Tensor ids = from_vector<int64_t>({3, 9, 27, 17, 51, 2, 60, 33}, {1, 8});
  const std::vector<float> want = model->logits(ids).to_vector<float>();
  // transformers 5.x's module names (model.language_model.*) load alike.
  StateDict renamed;
  for (const auto& [name, t] : stored)
    renamed.push_back({name.starts_with("language_model.model.")
                           ? "model.language_model." + name.substr(21)
                           : "model." + name,
                       t});
  CHECK(llm::CausalLM(c, renamed).logits(ids).to_vector<float>() == want);
  // Written back with the vision tower: the same names and bits, the same
  // config, the same logits.
  const TempDir out("quanta_gemma3_image_text");
  llm::save_causal_lm(*model, out.path().string(), llm::read_non_decoder_weights(c, dir));
  const StateDict again = llm::read_model_weights(out.path().string());
  REQUIRE(again.size() == stored.size());
  for (const auto& [name, t] : stored) {
    const Tensor* w = find_tensor(again, name);
    REQUIRE_MESSAGE(w != nullptr, name);
    CHECK(w->to_vector<float>() == t.to_vector<float>());
  }
  CHECK(llm::read_decoder_config(out.file("config.json")).image_text_config == c.image_text_config);
  CHECK(llm::load_causal_lm(out.path().string())->logits(ids).to_vector<float>() == want);
  // read_non_decoder_weights of a decoder's folder: nothing.
  CHECK(llm::read_non_decoder_weights(
            llm::load_causal_lm(data_dir() + "/models/gemma3_text")->config(),
            data_dir() + "/models/gemma3_text")
            .empty());
}

TEST_CASE("CausalLM: sim gives the CPU's bits") {
  auto cpu = llm::load_causal_lm(data_dir() + "/models/llama_gqa");
  auto sim = llm::load_causal_lm(data_dir() + "/models/llama_gqa", Device::sim(0));
  const Tensor ids = from_vector<int64_t>({1, 5, 9, 2, 7, 3}, {1, 6});
  CHECK(cpu->logits(ids).to_vector<float>() ==
        sim->logits(ids.to(Device::sim(0))).to(Device::cpu()).to_vector<float>());
}

TEST_CASE("CausalLM NEFTune: in training the embeddings gain transformers' uniform noise") {
  std::vector<Device> devices = {Device::cpu()};
  for (const Device dev : quanta::testing::test_devices()) devices.push_back(dev);
  for (const Device dev : devices) {
    CAPTURE(dev.str());
    // llama_gqa: untied, so moving embedding rows leaves the output layer alone.
    auto noisy = llm::load_causal_lm(data_dir() + "/models/llama_gqa", dev);
    auto plain = llm::load_causal_lm(data_dir() + "/models/llama_gqa", dev);
    noisy->set_neftune_noise(5.0, 7);
    CHECK(noisy->neftune_noise_alpha() == 5.0);
    CHECK(noisy->own_random_streams().size() == 1);
    CHECK(plain->own_random_streams().empty());
    NoGradGuard no_grad;
    // Distinct tokens: each position's noise can be written into its row.
    const std::vector<int64_t> seq = {4, 8, 15, 16, 23, 42};
    const int64_t T = 6, d = noisy->config().hidden_size;
    const Tensor ids = from_vector<int64_t>(seq, {1, T}).to(dev);
    const Tensor before = plain->logits(ids);
    {
      // Evaluation adds nothing and draws nothing.
      const EvalModeGuard eval(*noisy);
      CHECK(noisy->logits(ids).to(Device::cpu()).to_vector<float>() ==
            before.to(Device::cpu()).to_vector<float>());
    }
    // transformers' bound: alpha / sqrt(T d), from the stream "neftune" of the seed.
    Generator g = Generator::named(7, "neftune");
    const Tensor noise = empty({T, d}, {.dtype = DType::f32, .device = dev});
    uniform_(noise, -5.0 / std::sqrt(double(T * d)), 5.0 / std::sqrt(double(T * d)), g);
    Tensor w;
    for (const auto& [name, p] : plain->named_parameters())
      if (name == "model.embed_tokens.weight") w = p;
    REQUIRE(w.defined());
    std::vector<float> rows = w.to(Device::cpu()).to_vector<float>();
    const std::vector<float> n = noise.to(Device::cpu()).to_vector<float>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < d; ++k) rows[seq[t] * d + k] += n[t * d + k];
    copy_(w, from_vector<float>(rows, w.shape()).to(dev));
    const Tensor noisy_logits = noisy->logits(ids);
    CHECK(noisy_logits.to(Device::cpu()).to_vector<float>() ==
          plain->logits(ids).to(Device::cpu()).to_vector<float>());
    CHECK(noisy_logits.to(Device::cpu()).to_vector<float>() !=
          before.to(Device::cpu()).to_vector<float>());
    // The next forward draws the stream's next words: other noise.
    CHECK(noisy->logits(ids).to(Device::cpu()).to_vector<float>() !=
          noisy_logits.to(Device::cpu()).to_vector<float>());
  }
  auto model = llm::load_causal_lm(data_dir() + "/models/llama_gqa");
  CHECK_THROWS_WITH_AS(model->set_neftune_noise(-1, 0),
                       doctest::Contains("neftune_noise_alpha must be a finite number >= 0"),
                       std::invalid_argument);
}

TEST_CASE("CausalLM: a KV cache continues a sequence as a full forward would") {
  auto model = llm::load_causal_lm(data_dir() + "/models/llama_tied_llama3");
  NoGradGuard no_grad;
  const std::vector<int64_t> seq = {4, 8, 15, 16, 23, 42, 7, 1};
  const Tensor full = model->logits(from_vector<int64_t>(seq, {1, 8}));
  llm::KVCache cache;
  const Tensor head = model->logits(from_vector<int64_t>({4, 8, 15, 16, 23}, {1, 5}), &cache);
  CHECK(cache.length() == 5);
  const Tensor tail = model->logits(from_vector<int64_t>({42, 7, 1}, {1, 3}), &cache);
  CHECK(cache.length() == 8);
  CHECK(max_rel_diff(head, slice(full, 1, 0, 5)) < 1e-6);
  CHECK(max_rel_diff(tail, slice(full, 1, 5, 8)) < 1e-6);
}

TEST_CASE("CausalLM: padding keys hidden by attention_mask leave the other rows' logits alone") {
  auto model = llm::load_causal_lm(data_dir() + "/models/qwen2_bias");
  NoGradGuard no_grad;
  const Tensor one = model->logits(from_vector<int64_t>({5, 6, 7}, {1, 3}));
  // Right padding with junk ids: the real positions see only real keys.
  const Tensor ids = from_vector<int64_t>({5, 6, 7, 0, 0, 5, 6, 7, 9, 9}, {2, 5});
  const Tensor mask = from_vector<int64_t>({1, 1, 1, 0, 0, 1, 1, 1, 1, 1}, {2, 5});
  const Tensor padded = model->logits(ids, nullptr, mask);
  CHECK(max_rel_diff(slice(select(padded, 0, 0), 0, 0, 3), select(one, 0, 0)) < 1e-6);
}

TEST_CASE(
    "CausalLM: packed documents (restarting position_ids) equal transformers' and each "
    "document alone") {
  for (const std::string name : {"llama_gqa", "qwen2_bias"}) {
    INFO("model ", name);
    const io::SafetensorsFile want =
        io::load_safetensors(data_dir() + "/expected/packed_" + name + ".safetensors");
    const Tensor ids = expected(want, "input_ids"), positions = expected(want, "position_ids");
    const std::vector<Device> devices = cpu_and_test_devices();
    for (const Device dev : devices) {
      INFO("device ", dev.str());
      auto model = llm::load_causal_lm(data_dir() + "/models/" + name, dev);
      NoGradGuard no_grad;
      const Tensor logits =
          model->logits(ids.to(dev), nullptr, Tensor(), positions.to(dev)).to(Device::cpu());
      const double err = max_rel_diff(logits, expected(want, "logits"));
      MESSAGE(name << " packed on " << dev.str() << ": logits max |diff| / max |logit| = " << err);
      CHECK(err < 1e-5);
      const double loss =
          llm::causal_lm_loss(logits, expected(want, "labels")).to_vector<double>()[0];
      const double want_loss = expected(want, "loss").to_vector<double>()[0];
      CHECK(std::abs(loss - want_loss) < 1e-5 * want_loss);
      // Each document alone, at positions 0, 1, ...: the same logits.
      const std::vector<int64_t> pos = positions.to_vector<int64_t>();
      const int64_t T = ids.size(1);
      for (int64_t row = 0; row < ids.size(0); ++row)
        for (int64_t start = 0; start < T;) {
          int64_t end = start + 1;
          while (end < T && pos[row * T + end] != 0) ++end;
          const Tensor doc = slice(slice(ids, 0, row, row + 1), 1, start, end);
          const Tensor alone = model->logits(doc.to(dev)).to(Device::cpu());
          CHECK(max_rel_diff(slice(slice(logits, 0, row, row + 1), 1, start, end), alone) < 1e-5);
          start = end;
        }
    }
  }
  auto model = llm::load_causal_lm(data_dir() + "/models/llama_gqa");
  CHECK_THROWS_WITH_AS(model->logits(from_vector<int64_t>({1, 2, 3}, {1, 3}), nullptr, Tensor(),
                                     from_vector<int64_t>({0, 1}, {1, 2})),
                       doctest::Contains("position_ids must be i64 [1 or 1, 3]"),
                       std::invalid_argument);
}

TEST_CASE("packed examples: the loss and gradients of the examples alone") {
  TempDir tmp;
  const std::string path = (tmp.path() / "docs.jsonl").string();
  std::ofstream(path) << R"({"input_ids": [3, 9, 14, 2, 7]})"
                      << "\n"
                      << R"({"input_ids": [5, 5, 31, 8], "labels": [-100, -100, 31, 8]})"
                      << "\n"
                      << R"({"input_ids": [12, 40, 6, 1, 1, 9, 22]})"
                      << "\n"
                      << R"({"input_ids": [30, 2]})"
                      << "\n";
  const auto loss_and_grads = [&](bool pack) {
    auto model = llm::load_causal_lm(data_dir() + "/models/qwen2_bias");
    const llm::LmExamples data = llm::LmExamples::from_jsonl(path, 12, 64, {.pack = pack});
    const llm::LmBatch b = data.batch(arange(0.0, double(data.size()), 1.0, {.dtype = DType::i64}));
    const Tensor loss =
        llm::chunked_causal_lm_loss(model->hidden_states(b.ids, nullptr, Tensor(), b.position_ids),
                                    model->lm_head_weight(), b.labels, {.chunk_tokens = 5});
    loss.backward();
    std::vector<Tensor> out{loss};
    for (const Tensor& p : model->parameters()) out.push_back(p.grad());
    return std::make_pair(data.size(), out);
  };
  const auto [rows, packed] = loss_and_grads(true);
  const auto [examples, plain] = loss_and_grads(false);
  CHECK(rows == 2);
  CHECK(examples == 4);
  for (size_t i = 0; i < plain.size(); ++i) {
    INFO("tensor ", i);
    CHECK(max_rel_diff(packed[i], plain[i]) < 1e-5);
  }
}

// LongRoPE picks its factors from the largest position, as transformers
// does: two packed documents of 6 tokens each (positions restarting) over
// an original length of 8 take the short factors, as each does alone,
// though the row is 12 tokens long.
TEST_CASE("CausalLM: longrope over packed documents counts their positions") {
  auto model = llm::load_causal_lm(data_dir() + "/models/phi3_longrope");
  NoGradGuard no_grad;
  const std::vector<int64_t> a = {3, 9, 14, 2, 7, 40}, b = {5, 31, 8, 12, 60, 1};
  std::vector<int64_t> both = a;
  both.insert(both.end(), b.begin(), b.end());
  const Tensor positions = from_vector<int64_t>({0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5}, {1, 12});
  for (const Device dev : std::vector<Device>{Device::cpu(), Device::sim(0)}) {
    INFO("device ", dev.str());
    const Tensor packed = model
                              ->logits(from_vector<int64_t>(both, {1, 12}).to(dev), nullptr,
                                       Tensor(), positions.to(dev))
                              .to(Device::cpu());
    const Tensor alone_a = model->logits(from_vector<int64_t>(a, {1, 6})).to(Device::cpu());
    const Tensor alone_b = model->logits(from_vector<int64_t>(b, {1, 6})).to(Device::cpu());
    CHECK(max_rel_diff(slice(packed, 1, 0, 6), alone_a) < 1e-6);
    CHECK(max_rel_diff(slice(packed, 1, 6, 12), alone_b) < 1e-6);
    // Unpacked, the 12 tokens are past the original length: the long factors.
    const Tensor whole = model->logits(from_vector<int64_t>(both, {1, 12})).to(Device::cpu());
    CHECK(max_rel_diff(slice(whole, 1, 0, 6), alone_a) > 1e-3);
  }
}

TEST_CASE("CausalLM: f64 directional finite difference through the whole model") {
  llm::DecoderConfig config = tiny_config(DType::f64);
  SUBCASE("llama, every bias") {}
  SUBCASE("qwen3's q and k norms") { config.model_type = "qwen3", config.qk_norm = true; }
  bool chunked = false;
  SUBCASE("gemma3: q and k norms of 1 + weight, a window, a RoPE per layer type") {
    config.model_type = "gemma3_text", config.hidden_act = llm::GatedAct::gelu_tanh;
    config.gemma_norms = true, config.sandwich_norms = true, config.qk_norm = true;
    config.sliding_window = 2, config.sliding_layers = {true, false};
    config.sliding_rope = config.rope;
    config.sliding_rope->theta = 100;
  }
  SUBCASE("phi3: fused projections, half of each head rotated, longrope's long factors") {
    config.model_type = "phi3", config.fused_projections = true;
    config.rope.head_dim = 2;  // of 4
    config.rope.scaling.type = "longrope";
    config.rope.scaling.original_max_position_embeddings = 2;  // the 4 tokens are past it
    config.rope.scaling.short_factor = {1.0};
    config.rope.scaling.long_factor = {3.0};
  }
  SUBCASE("olmo2: norms only after each block, q and k normalized over all heads") {
    config.model_type = "olmo2", config.post_norms = true;
    config.qk_norm = true, config.qk_norm_whole = true;
  }
  SUBCASE("smollm3: a layer without RoPE") {
    config.model_type = "smollm3", config.nope_layers = {false, true};
  }
  SUBCASE("olmo3: a sliding layer, YaRN on the full one") {
    config.model_type = "olmo3", config.post_norms = true;
    config.qk_norm = true, config.qk_norm_whole = true;
    config.sliding_window = 2, config.sliding_layers = {true, false};
    config.sliding_rope = config.rope;
    config.rope.scaling.type = "yarn", config.rope.scaling.factor = 4;
    config.rope.scaling.original_max_position_embeddings = 16;
  }
  SUBCASE("granite: its four scalings, the logits' divisor in the chunked loss") {
    config.model_type = "granite", config.embedding_multiplier = 3;
    config.residual_multiplier = 0.4, config.attention_multiplier = 0.3;
    config.logits_scaling = 2.5;
    chunked = true;
  }
  SUBCASE("gemma2: GeGLU, 1 + weight norms, four a layer, soft-capped scores and logits") {
    config.model_type = "gemma2", config.hidden_act = llm::GatedAct::gelu_tanh;
    config.gemma_norms = true, config.sandwich_norms = true, config.query_pre_attn_scalar = 3;
    // Caps inside the values' spread, so that tanh bends them.
    config.attn_logit_softcapping = 0.8, config.final_logit_softcapping = 1.5;
    chunked = true;
  }
  Generator gen(5);
  auto model = llm::CausalLM::random(config, gen, Device::cpu(), 0.5);
  // Norms moved off their identity (0 for Gemma's), so a wrong scale shows.
  for (auto& [name, p] : model->named_parameters())
    if (name.find("norm") != std::string::npos) {
      NoGradGuard no_grad;
      copy_(p, add(p, randn(p.shape(), gen, {.dtype = DType::f64}) * 0.3));
    }
  const Tensor ids = from_vector<int64_t>({1, 4, 9, 2, 10, 3, 0, 5}, {2, 4});
  // Gemma 2's and Granite's through the chunked loss too (its soft-capped
  // and divided gradients).
  const auto loss = [&] {
    return chunked ? model->lm_loss(model->hidden_states(ids), ids, 3)
                   : llm::causal_lm_loss(model->logits(ids), ids);
  };
  Tensor l = loss();
  l.backward();
  std::vector<Tensor> dirs;
  double analytic = 0;
  Generator dgen(6);
  for (const Tensor& p : model->parameters()) {
    dirs.push_back(randn(p.shape(), dgen, {.dtype = DType::f64}));
    analytic += sum(mul(p.grad(), dirs.back())).to_vector<double>()[0];
  }
  const double eps = 1e-6;
  const auto shifted = [&](double s) {
    NoGradGuard no_grad;
    const auto ps = model->parameters();
    for (size_t i = 0; i < ps.size(); ++i) copy_(ps[i], add(ps[i], dirs[i] * s));
    const double v = loss().to_vector<double>()[0];
    for (size_t i = 0; i < ps.size(); ++i) copy_(ps[i], sub(ps[i], dirs[i] * s));
    return v;
  };
  const double numeric = (shifted(eps) - shifted(-eps)) / (2 * eps);
  CHECK(std::abs(numeric - analytic) <= 1e-6 * std::max(1.0, std::abs(analytic)));
}

TEST_CASE("TrainableTokens: lookup equals the embedding of apply(), values and gradients") {
  // A trained row at the padding index and one never read; ids repeat the
  // trained rows so their gradients sum positions; a weight that trains too.
  for (const Device dev : {Device::cpu(), Device::sim(0)})
    for (const bool weight_trains : {false, true}) {
      INFO("device ", dev.str(), weight_trains ? ", the weight trains" : "");
      Generator gen(21);
      Tensor weight = randn({9, 5}, gen, {.dtype = DType::f64}).to(dev);
      weight.requires_grad_(weight_trains);
      const llm::TrainableTokens tokens(weight, {6, 1, 3, 8});
      Tensor values = tokens.values();
      values.requires_grad_(true);
      {
        NoGradGuard no_grad;  // moved off the weight's rows, so a mix-up shows
        copy_(values, add(values, full_like(values, 0.25)));
      }
      const Tensor ids = from_vector<int64_t>({6, 2, 1, 6, 0, 3, 3, 6, 5, 2, 1, 4}, {3, 4}).to(dev);
      const Tensor dir = randn({3, 4, 5}, gen, {.dtype = DType::f64}).to(dev);
      const int64_t padding_idx = 3;
      const std::vector<Tensor> wrt =
          weight_trains ? std::vector<Tensor>{values, weight} : std::vector<Tensor>{values};
      const Tensor fast = tokens.lookup(weight, ids, padding_idx);
      const Tensor plain = embedding(tokens.apply(weight), ids, padding_idx);
      CHECK(fast.to(Device::cpu()).to_vector<double>() ==
            plain.to(Device::cpu()).to_vector<double>());
      const auto g_fast = autograd::grad({sum(mul(fast, dir))}, wrt);
      const auto g_plain = autograd::grad({sum(mul(plain, dir))}, wrt);
      for (size_t i = 0; i < wrt.size(); ++i) CHECK(max_rel_diff(g_fast[i], g_plain[i]) < 1e-15);
      // The rows of the padding token (3, slot 2) and of the unread one (8,
      // slot 3) get no gradient.
      const std::vector<double> gv = g_fast[0].to(Device::cpu()).to_vector<double>();
      for (int c = 0; c < 5; ++c) {
        CHECK(gv[2 * 5 + c] == 0.0);
        CHECK(gv[3 * 5 + c] == 0.0);
        CHECK(gv[0 * 5 + c] != 0.0);
      }
    }
}

TEST_CASE("chunked_causal_lm_loss equals the plain loss, values and gradients") {
  Generator gen(7);
  auto model = llm::CausalLM::random(tiny_config(DType::f64), gen, Device::cpu(), 0.5);
  const Tensor ids = from_vector<int64_t>({1, 4, 9, 2, 10, 3, 0, 5, 6, 7}, {2, 5});
  Tensor labels = ids.clone();
  copy_(select(select(labels, 0, 1), 0, 2), full({}, -100, {.dtype = DType::i64}));
  for (const Device dev : {Device::cpu(), Device::sim(0)}) {
    INFO("device ", dev.str());
    const Tensor h = model->hidden_states(ids).detach().to(dev).requires_grad_(true);
    const Tensor w = model->lm_head_weight().detach().to(dev).requires_grad_(true);
    const Tensor plain = llm::causal_lm_loss(linear(h, w), labels.to(dev));
    const auto g_plain = autograd::grad({plain}, {h, w});
    const Tensor chunked = llm::chunked_causal_lm_loss(h, w, labels.to(dev), {.chunk_tokens = 3});
    const auto g_chunked = autograd::grad({chunked}, {h, w});
    CHECK(std::abs(plain.to_vector<double>()[0] - chunked.to_vector<double>()[0]) < 1e-12);
    CHECK(max_rel_diff(g_chunked[0], g_plain[0]) < 1e-12);
    CHECK(max_rel_diff(g_chunked[1], g_plain[1]) < 1e-12);
    // A frozen weight (QLoRA's lm_head): the hidden states' gradient alone.
    const Tensor frozen = model->lm_head_weight().detach().to(dev);
    const Tensor g_frozen = autograd::grad(
        {llm::chunked_causal_lm_loss(h, frozen, labels.to(dev), {.chunk_tokens = 4}) * 3.0},
        {h})[0];
    CHECK(max_rel_diff(g_frozen, g_plain[0] * 3.0) < 1e-12);
    // A weight of which only some rows train: the gradient goes to their
    // values, the weight (holding them) read as a constant.
    const Tensor rows = from_vector<int64_t>({7, 2, 9}, {3}).to(dev);
    const Tensor values = index_select(w.detach(), 0, rows).requires_grad_(true);
    const Tensor rows_loss = llm::chunked_causal_lm_loss(
        h, w.detach(), labels.to(dev),
        {.chunk_tokens = 3, .trained_rows = rows, .trained_values = values});
    CHECK(rows_loss.to_vector<double>()[0] == doctest::Approx(plain.to_vector<double>()[0]));
    const auto g_rows = autograd::grad({rows_loss}, {h, values});
    CHECK(max_rel_diff(g_rows[0], g_plain[0]) < 1e-12);
    CHECK(max_rel_diff(g_rows[1], index_select(g_plain[1], 0, rows)) < 1e-12);
    CHECK_THROWS_WITH_AS(
        llm::chunked_causal_lm_loss(
            h, w, labels.to(dev),
            {.chunk_tokens = 3, .trained_rows = rows.to(DType::i32), .trained_values = values}),
        doctest::Contains("trained_rows must be 1-d i64"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(llm::chunked_causal_lm_loss(h, w, labels.to(dev),
                                                     {.chunk_tokens = 3, .trained_rows = rows}),
                         doctest::Contains("trained_rows and trained_values go together"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(
        llm::chunked_causal_lm_loss(
            h, w, labels.to(dev),
            {.chunk_tokens = 3, .trained_rows = rows, .trained_values = slice(values, 0, 0, 2)}),
        doctest::Contains("trained_values must be [3, 8]"), std::invalid_argument);
    // Its gradients are formed once: a second backward is refused.
    const Tensor once = llm::chunked_causal_lm_loss(h, w, labels.to(dev), {.chunk_tokens = 3});
    autograd::grad({once}, {h}, {}, /*retain_graph=*/true);
    CHECK_THROWS_WITH_AS(autograd::grad({once}, {h}), doctest::Contains("backward ran twice"),
                         std::runtime_error);
  }
}

TEST_CASE(
    "chunked_causal_lm_loss: fused loss rows on every device, f32 and f64, eval, bad targets") {
  // Each chunk's rows go through the table's lm_loss_rows (loss and, in
  // place, softmax less the target): against the plain loss over the whole
  // logits, with an ignored label, chunks that do not divide the rows, a
  // frozen weight; without grad mode the loss alone.
  for (const Device dev : test_devices())
    for (const DType dt : {DType::f32, DType::f64}) {
      INFO("device ", dev.str(), " ", dtype_name(dt));
      Generator gen(11);
      const Tensor h = randn({2, 6, 8}, gen, {.dtype = dt}).to(dev).requires_grad_(true);
      const Tensor w = randn({37, 8}, gen, {.dtype = dt}).to(dev);
      Tensor labels = randint(0, 37, {2, 6}, gen);
      copy_(select(select(labels, 0, 0), 0, 3), full({}, -100, {.dtype = DType::i64}));
      const Tensor plain = llm::causal_lm_loss(linear(h, w), labels.to(dev));
      const Tensor g_plain = autograd::grad({plain}, {h})[0];
      const Tensor chunked = llm::chunked_causal_lm_loss(h, w, labels.to(dev), {.chunk_tokens = 4});
      const Tensor g_chunked = autograd::grad({chunked}, {h})[0];
      const double tol = dt == DType::f32 ? 1e-5 : 1e-12;
      CHECK(std::abs(plain.to_vector<double>()[0] - chunked.to_vector<double>()[0]) <
            tol * std::abs(plain.to_vector<double>()[0]));
      CHECK(max_rel_diff(g_chunked, g_plain) < tol);
      NoGradGuard no_grad;
      const Tensor eval = llm::chunked_causal_lm_loss(h, w, labels.to(dev), {.chunk_tokens = 5});
      CHECK_FALSE(eval.requires_grad());
      CHECK(std::abs(plain.to_vector<double>()[0] - eval.to_vector<double>()[0]) <
            tol * std::abs(plain.to_vector<double>()[0]));
    }
  // A target outside the vocabulary (and not ignore_index) is named.
  Generator gen(12);
  const Tensor h = randn({1, 4, 8}, gen).requires_grad_(true);
  const Tensor w = randn({37, 8}, gen);
  const Tensor bad = from_vector<int64_t>({1, 2, 37, 3}, {1, 4});
  CHECK_THROWS_WITH_AS(llm::chunked_causal_lm_loss(h, w, bad),
                       doctest::Contains("target 37 is out of range for a vocabulary of 37"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(llm::chunked_causal_lm_loss(h, w, from_vector<int64_t>({1, 2, 3, 4}, {1, 4}),
                                                   {.chunk_tokens = -1}),
                       doctest::Contains("chunk_tokens must be >= 0"), std::invalid_argument);
  // The automatic chunk: one chunk's f32 logits within kLossChunkBytes.
  CHECK(llm::loss_chunk_tokens(32000) == 1024);
  CHECK(llm::loss_chunk_tokens(128256) == 256);
  CHECK(llm::loss_chunk_tokens(4) == llm::kLossChunkBytes / 16);
  CHECK(llm::loss_chunk_tokens(int64_t{1} << 40) == 64);
}

TEST_CASE("CausalLM: save writes a folder that loads back to the same weights") {
  TempDir tmp;
  auto model = llm::load_causal_lm(data_dir() + "/models/llama_tied_llama3");
  llm::save_causal_lm(*model, (tmp.path() / "copy").string());
  auto again = llm::load_causal_lm((tmp.path() / "copy").string());
  CHECK(again->config().rope.scaling.type == "llama3");
  CHECK(again->config().tie_word_embeddings);
  const StateDict a = model->state_dict(), b = again->state_dict();
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].first == b[i].first);
    CHECK(a[i].second.to_vector<float>() == b[i].second.to_vector<float>());
  }
}

// transformers 5.24, given such a file, unties the two and uses the stored
// lm_head (checked in ../shared/peer's environment): a tied model with a
// different lm_head is two models, refused; a copy of the embeddings loads.
TEST_CASE("CausalLM: a tied model takes a stored lm_head only as a copy of the embeddings") {
  const std::string dir = data_dir() + "/models/llama_gqa";
  llm::DecoderConfig c = llm::read_decoder_config(dir + "/config.json");
  REQUIRE_FALSE(c.tie_word_embeddings);
  c.tie_word_embeddings = true;
  StateDict w = llm::read_model_weights(dir);
  CHECK_THROWS_WITH_AS(llm::CausalLM(c, w),
                       doctest::Contains("lm_head.weight that differs from "
                                         "model.embed_tokens.weight"),
                       std::invalid_argument);
  Tensor embed;
  for (const auto& [name, t] : w)
    if (name == "model.embed_tokens.weight") embed = t;
  for (auto& [name, t] : w)
    if (name == "lm_head.weight") t = embed.clone();
  const llm::CausalLM tied(c, w);
  CHECK(tied.lm_head_weight().to_vector<float>() == embed.to_vector<float>());
  // A copy stored in another dtype is compared in the model's.
  for (auto& [name, t] : w)
    if (name == "lm_head.weight") t = embed.to(DType::f64);
  CHECK_NOTHROW(llm::CausalLM(c, w));
}

TEST_CASE("CausalLM: every wrong weight listed in one error") {
  const std::string dir = data_dir() + "/models/llama_gqa";
  const llm::DecoderConfig c = llm::read_decoder_config(dir + "/config.json");
  StateDict w = llm::read_model_weights(dir);
  w.erase(w.begin() + 1);  // a missing one
  w.push_back({"model.layers.9.mlp.gate_proj.weight", zeros({2, 2})});
  for (auto& [name, t] : w)
    if (name == "model.norm.weight") t = zeros({31});
  try {
    llm::CausalLM model(c, w);
    FAIL("no error");
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    CHECK(m.find("missing (1)") != std::string::npos);
    CHECK(m.find("unexpected (1):\n    model.layers.9.mlp.gate_proj.weight") != std::string::npos);
    CHECK(m.find("model.norm.weight is [31], expected [32]") != std::string::npos);
  }
}

TEST_CASE("decoder configs: clear errors for what quanta does not run") {
  const auto parse = [](const std::string& extra) {
    return llm::parse_decoder_config(
        R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 32)" +
            extra + "}",
        "cfg.json");
  };
  CHECK(parse("").num_key_value_heads == 2);
  CHECK(parse("").head_dim == 4);
  CHECK_THROWS_WITH(parse(R"(, "hidden_act": "gelu")"),
                    doctest::Contains("cfg.json: hidden_act \"gelu\" is not supported"));
  CHECK_THROWS_WITH(parse(R"(, "rope_scaling": {"rope_type": "mrope", "factor": 4.0})"),
                    doctest::Contains("rope_scaling type \"mrope\" is not supported"));
  CHECK_THROWS_WITH(parse(R"(, "rope_interleaved": true)"), doctest::Contains("rope_interleaved"));
  CHECK_THROWS_WITH(parse(R"(, "num_key_value_heads": 3)"),
                    doctest::Contains("not a multiple of num_key_value_heads 3"));
  CHECK_THROWS_WITH(parse(R"(, "torch_dtype": "int8")"),
                    doctest::Contains("dtype \"int8\" is not one quanta loads"));
  CHECK_THROWS_WITH(llm::parse_decoder_config(R"({"model_type": "gpt2"})", "cfg.json"),
                    doctest::Contains("model_type \"gpt2\" is not supported"));
  CHECK_THROWS_WITH(parse(R"(, "layer_types": ["sliding_attention"])"),
                    doctest::Contains("only full_attention is supported"));
  CHECK_THROWS_WITH(llm::parse_decoder_config(R"({"model_type": "llama"})", "cfg.json"),
                    doctest::Contains("missing \"vocab_size\""));
  CHECK_THROWS_WITH(llm::read_decoder_config("/nonexistent/config.json"),
                    doctest::Contains("cannot open"));
}

// Each expectation is what transformers 5.24 computes with for the same keys
// (LlamaConfig(**config).rope_parameters, and for llama3's original length
// the rotary embedding's inv_freq; run in ../shared/peer's environment).
TEST_CASE("decoder configs: RoPE settings resolved as transformers resolves them") {
  const auto rope = [](const std::string& extra) {
    return llm::parse_decoder_config(
               R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
                   "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "max_position_embeddings": 128)" +
                   extra + "}",
               "cfg.json")
        .rope;
  };
  SUBCASE("a non-empty rope_scaling replaces rope_parameters") {
    const llm::RopeConfig r = rope(R"(, "rope_parameters": {"rope_type": "default",
        "rope_theta": 10000.0}, "rope_scaling": {"type": "linear", "factor": 4.0})");
    CHECK(r.scaling.type == "linear");
    CHECK(r.scaling.factor == 4.0);
    CHECK(r.theta == 10000.0);
  }
  SUBCASE("an empty or null rope_scaling leaves rope_parameters") {
    for (const char* scaling : {"{}", "null"}) {
      const llm::RopeConfig r = rope(std::string(R"(, "rope_parameters": {"rope_type": "linear",
          "factor": 2.0, "rope_theta": 300.0}, "rope_scaling": )") +
                                     scaling);
      CHECK(r.scaling.type == "linear");
      CHECK(r.scaling.factor == 2.0);
      CHECK(r.theta == 300.0);
    }
  }
  SUBCASE("rope_theta outside the object is the default for the one inside") {
    CHECK(rope(R"(, "rope_parameters": {"rope_type": "default"}, "rope_theta": 500.0)").theta ==
          500.0);
    CHECK(rope(R"(, "rope_parameters": {}, "rope_theta": 500.0)").theta == 500.0);
    CHECK(rope(R"(, "rope_theta": 500.0, "rope_scaling": {"type": "linear", "factor": 2.0,
        "rope_theta": 7.0})")
              .theta == 7.0);
    CHECK(rope(R"(, "rope_theta": 500.0, "rope_scaling": null)").theta == 500.0);
    CHECK(rope("").theta == 10000.0);
  }
  SUBCASE("rope_type wins over type") {
    CHECK(rope(R"(, "rope_parameters": {"rope_type": "linear", "type": "dynamic",
        "factor": 2.0})")
              .scaling.type == "linear");
  }
  SUBCASE("llama3's original_max_position_embeddings: top level, inside, then max") {
    // What LlamaRotaryEmbedding computes with (its inv_freq), which reads a
    // top-level key over the one in rope_scaling.
    const std::string llama3 = R"("rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0)";
    const auto original = [&](const std::string& top, const std::string& inside) {
      const llm::RopeConfig r =
          rope(R"(, "rope_theta": 500.0)" + top + R"(, "rope_scaling": {)" + llama3 + inside + "}");
      CHECK(r.scaling.type == "llama3");
      CHECK(r.theta == 500.0);
      return r.scaling.original_max_position_embeddings;
    };
    CHECK(original("", "") == 128);
    CHECK(original("", R"(, "original_max_position_embeddings": 64)") == 64);
    CHECK(original(R"(, "original_max_position_embeddings": 64)", "") == 64);
    CHECK(original(R"(, "original_max_position_embeddings": 1024)",
                   R"(, "original_max_position_embeddings": 512)") == 1024);
  }
  SUBCASE("a rope_scaling of the wrong kind is refused, as before") {
    CHECK_THROWS_WITH(rope(R"(, "rope_scaling": [1])"),
                      doctest::Contains("\"rope_scaling\" must be an object or null"));
    CHECK_THROWS_WITH(rope(R"(, "rope_parameters": {"rope_type": "default"},
        "rope_scaling": {"rope_type": "dynamic_yarn", "factor": 2.0})"),
                      doctest::Contains("rope_scaling type \"dynamic_yarn\" is not supported"));
  }
  SUBCASE("yarn: Qwen's 4.x rope_scaling, DeepSeek's keys, each written back") {
    // Qwen2.5's and Qwen3's model cards add this object to extend 32768
    // positions fourfold.
    llm::RopeConfig r = rope(R"(, "rope_theta": 1000000.0, "rope_scaling": {"type": "yarn",
        "factor": 4.0, "original_max_position_embeddings": 32})");
    CHECK(r.scaling.type == "yarn");
    CHECK(r.scaling.factor == 4.0);
    CHECK(r.scaling.original_max_position_embeddings == 32);
    CHECK(r.scaling.attention_factor == 0);  // derived: 0.1 ln 4 + 1
    CHECK(r.scaling.truncate);
    // No original length: max_position_embeddings (then an implicit factor
    // of 1); a top-level one wins.
    CHECK(rope(R"(, "rope_scaling": {"rope_type": "yarn", "factor": 2.0})")
              .scaling.original_max_position_embeddings == 128);
    CHECK(rope(R"(, "original_max_position_embeddings": 16, "rope_scaling": {"rope_type": "yarn",
        "factor": 2.0, "original_max_position_embeddings": 64})")
              .scaling.original_max_position_embeddings == 16);
    const std::string deepseek = R"(, "rope_scaling": {"rope_type": "yarn", "factor": 40,
        "original_max_position_embeddings": 4, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
        "mscale_all_dim": 0.8, "truncate": false, "attention_factor": 1.25})";
    r = rope(deepseek);
    CHECK(r.scaling.beta_fast == 32);
    CHECK(r.scaling.beta_slow == 1);
    CHECK(r.scaling.mscale == 1.0);
    CHECK(r.scaling.mscale_all_dim == 0.8);
    CHECK_FALSE(r.scaling.truncate);
    CHECK(r.scaling.attention_factor == 1.25);
    llm::DecoderConfig c = llm::parse_decoder_config(
        R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 128)" +
            deepseek + "}",
        "cfg.json");
    const llm::DecoderConfig again =
        llm::parse_decoder_config(llm::decoder_config_json(c), "written.json");
    CHECK(again.rope.scaling.type == "yarn");
    CHECK(again.rope.scaling.factor == 40);
    CHECK(again.rope.scaling.original_max_position_embeddings == 4);
    CHECK(again.rope.scaling.mscale_all_dim == 0.8);
    CHECK_FALSE(again.rope.scaling.truncate);
    CHECK(again.rope.scaling.attention_factor == 1.25);
    CHECK(llm::rope_frequencies(again.rope).inv_freq == llm::rope_frequencies(c.rope).inv_freq);
    CHECK_THROWS_WITH(rope(R"(, "rope_scaling": {"rope_type": "yarn", "factor": 2.0,
        "truncate": 1})"),
                      doctest::Contains("rope_scaling \"truncate\" must be true or false"));
    CHECK_THROWS_WITH(rope(R"(, "rope_scaling": {"rope_type": "yarn", "factor": 2.0,
        "attention_factor": -1})"),
                      doctest::Contains("\"attention_factor\" must be > 0"));
  }
}

// What transformers 5.24's MistralConfig and Qwen2Config make of the keys:
// mistral slides every layer (4096 when sliding_window is absent, none when
// null); qwen2 only with use_sliding_window, the layers from
// max_window_layers or those layer_types names.
TEST_CASE("decoder configs: sliding windows read as transformers reads them, written back") {
  const auto parse = [](const std::string& type, const std::string& extra) {
    return llm::parse_decoder_config(R"({"model_type": ")" + type +
                                         R"(", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2,
            "num_key_value_heads": 2, "max_position_embeddings": 32)" +
                                         extra + "}",
                                     "cfg.json");
  };
  struct Case {
    const char* type;
    const char* extra;
    int64_t window, from;
  };
  const Case cases[] = {
      {"mistral", "", 4096, 0},
      {"mistral", R"(, "sliding_window": null)", 0, 0},
      {"mistral", R"(, "sliding_window": 16)", 16, 0},
      {"llama", R"(, "sliding_window": 16)", 0, 0},
      {"qwen2", R"(, "sliding_window": 16)", 0, 0},
      {"qwen2", R"(, "use_sliding_window": true, "sliding_window": 16)", 0, 0},  // from 28
      {"qwen2", R"(, "use_sliding_window": true, "sliding_window": 16, "max_window_layers": 1)", 16,
       1},
      {"qwen2", R"(, "use_sliding_window": true, "sliding_window": 16, "max_window_layers": 0)", 16,
       0},
      {"qwen2", R"(, "use_sliding_window": true, "sliding_window": null, "max_window_layers": 0)",
       0, 0},
      {"qwen2", R"(, "use_sliding_window": true, "sliding_window": 16, "max_window_layers": 0,
          "layer_types": ["full_attention", "full_attention", "sliding_attention"])",
       16, 2},
      {"qwen2", R"(, "use_sliding_window": true, "sliding_window": 16,
          "layer_types": ["attention", "full_attention", "sliding_attention"])",
       16, 2},
      {"llama", R"(, "layer_types": ["attention", "full_attention", "attention"])", 0, 0},
      {"qwen2", R"(, "use_sliding_window": false, "sliding_window": 16,
          "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention"])",
       0, 0},
      {"qwen3", R"(, "sliding_window": 16)", 0, 0},
      {"qwen3", R"(, "use_sliding_window": true, "sliding_window": 16, "max_window_layers": 1)", 16,
       1},
      {"qwen3", R"(, "use_sliding_window": true, "sliding_window": 16,
          "layer_types": ["full_attention", "sliding_attention", "sliding_attention"])",
       16, 1},
  };
  for (const Case& c : cases) {
    CAPTURE(c.type);
    CAPTURE(c.extra);
    const llm::DecoderConfig d = parse(c.type, c.extra);
    CHECK(d.sliding_window == c.window);
    if (c.window > 0) CHECK(d.max_window_layers == c.from);
    // Written back (4.x names) and read again: the same window.
    const llm::DecoderConfig again =
        llm::parse_decoder_config(llm::decoder_config_json(d), "written.json");
    CHECK(again.sliding_window == d.sliding_window);
    CHECK(again.max_window_layers == d.max_window_layers);
  }
  CHECK_THROWS_WITH(parse("qwen2", R"(, "use_sliding_window": true, "sliding_window": 16,
      "layer_types": ["sliding_attention", "full_attention", "sliding_attention"])"),
                    doctest::Contains("other than the last ones"));
  CHECK_THROWS_WITH(parse("qwen2", R"(, "layer_types": ["full_attention"])"),
                    doctest::Contains("one type per layer (3)"));
  CHECK_THROWS_WITH(parse("mistral", R"(, "layer_types": ["sliding_attention",
      "sliding_attention", "sliding_attention"])"),
                    doctest::Contains("only full_attention is supported"));
  CHECK_THROWS_WITH(parse("mistral", R"(, "sliding_window": -4)"),
                    doctest::Contains("\"sliding_window\" must be > 0"));
  CHECK_THROWS_WITH(parse("qwen2", R"(, "use_sliding_window": true, "max_window_layers": -1)"),
                    doctest::Contains("\"max_window_layers\" must be an integer >= 0"));
}

// What each model type's config class in transformers 5.24 makes of the
// keys (Qwen3Config, MistralConfig, Qwen2Config, LlamaConfig, and the
// modules' bias= arguments).
TEST_CASE("decoder configs: qwen3 and each model type's defaults and biases") {
  const auto parse = [](const std::string& type, const std::string& extra) {
    return llm::parse_decoder_config(R"({"model_type": ")" + type +
                                         R"(", "vocab_size": 10, "hidden_size": 48,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 64,
            "max_position_embeddings": 32)" +
                                         extra + "}",
                                     "cfg.json");
  };
  // Qwen3: head_dim 128 when absent, whatever hidden_size / heads is.
  const llm::DecoderConfig q3 = parse("qwen3", "");
  CHECK(q3.head_dim == 128);
  CHECK(q3.qk_norm);
  CHECK_FALSE(q3.qkv_bias);
  CHECK_FALSE(q3.o_bias);
  CHECK(parse("qwen3", R"(, "head_dim": 16)").head_dim == 16);
  CHECK_FALSE(parse("qwen2", R"(, "head_dim": 16)").qk_norm);
  // num_key_value_heads absent: the class default; null: the heads.
  CHECK(q3.num_key_value_heads == 32);
  CHECK(parse("qwen2", R"(, "head_dim": 16)").num_key_value_heads == 32);
  CHECK(parse("mistral", R"(, "head_dim": 16)").num_key_value_heads == 8);
  CHECK(parse("llama", R"(, "head_dim": 16)").num_key_value_heads == 64);
  CHECK(parse("mistral", R"(, "head_dim": 16, "num_key_value_heads": null)").num_key_value_heads ==
        64);
  CHECK_THROWS_WITH(
      llm::parse_decoder_config(R"({"model_type": "mistral", "vocab_size": 10, "hidden_size": 8,
          "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
          "max_position_embeddings": 32})",
                                "cfg.json"),
      doctest::Contains("not a multiple of num_key_value_heads 8 (the key is absent"));
  // Biases: Qwen3's attention_bias on q, k, v and o, never the MLP's;
  // Qwen2's q, k and v always; Mistral none; Llama both keys.
  const std::string both = R"(, "head_dim": 16, "attention_bias": true, "mlp_bias": true)";
  const llm::DecoderConfig q3b = parse("qwen3", both), q2 = parse("qwen2", both),
                           mi = parse("mistral", both), ll = parse("llama", both);
  CHECK((q3b.qkv_bias && q3b.o_bias && !q3b.mlp_bias));
  CHECK((q2.qkv_bias && !q2.o_bias && !q2.mlp_bias));
  CHECK((!mi.qkv_bias && !mi.o_bias && !mi.mlp_bias));
  CHECK((ll.qkv_bias && ll.o_bias && ll.mlp_bias));
  // Written back and read again: the same model.
  for (const llm::DecoderConfig& d : {q3, q3b, q2, mi, ll}) {
    CAPTURE(d.model_type);
    const llm::DecoderConfig again =
        llm::parse_decoder_config(llm::decoder_config_json(d), "written.json");
    CHECK(again.model_type == d.model_type);
    CHECK(again.head_dim == d.head_dim);
    CHECK(again.num_key_value_heads == d.num_key_value_heads);
    CHECK(again.qk_norm == d.qk_norm);
    CHECK(again.qkv_bias == d.qkv_bias);
    CHECK(again.o_bias == d.o_bias);
    CHECK(again.mlp_bias == d.mlp_bias);
    CHECK(again.parameter_count() == d.parameter_count());
  }
  // Qwen3's q_norm and k_norm: head_dim weights each, per layer.
  CHECK(q3.parameter_count() -
            parse("qwen2", R"(, "head_dim": 128, "num_key_value_heads": 32)").parameter_count() ==
        2 * 128 - (64 * 128 + 2 * 32 * 128));
}

// What GemmaConfig and Gemma2Config in transformers 5.24 (and 4.x's
// hidden_activation) make of the keys.
TEST_CASE("decoder configs: gemma and gemma2, their defaults, activations and caps") {
  const auto parse = [](const std::string& type, const std::string& extra) {
    return llm::parse_decoder_config(R"({"model_type": ")" + type +
                                         R"(", "vocab_size": 10, "hidden_size": 48,
            "intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 16,
            "max_position_embeddings": 32)" +
                                         extra + "}",
                                     "cfg.json");
  };
  const llm::DecoderConfig g = parse("gemma", ""), g2 = parse("gemma2", "");
  // Class defaults: head_dim 256, tied, kv heads 16 (gemma) and 4 (gemma2),
  // GELU's tanh approximation; gemma2's scale from query_pre_attn_scalar
  // 256, caps 50 and 30, a window of 4096 on every other layer from 0.
  for (const llm::DecoderConfig& d : {g, g2}) {
    CAPTURE(d.model_type);
    CHECK(d.head_dim == 256);
    CHECK(d.tie_word_embeddings);
    CHECK(d.hidden_act == llm::GatedAct::gelu_tanh);
    CHECK(d.gemma_norms);
    CHECK_FALSE(d.qk_norm);
  }
  CHECK(g.num_key_value_heads == 16);
  CHECK_FALSE(g.sandwich_norms);
  CHECK(g.attention_scale() == doctest::Approx(1 / 16.0).epsilon(1e-15));
  CHECK(g.attn_logit_softcapping == 0);
  CHECK(g.final_logit_softcapping == 0);
  CHECK(g.sliding_window == 0);
  CHECK(g2.num_key_value_heads == 4);
  CHECK(g2.sandwich_norms);
  CHECK(g2.query_pre_attn_scalar == 256);
  CHECK(g2.attn_logit_softcapping == 50);
  CHECK(g2.final_logit_softcapping == 30);
  CHECK(g2.sliding_window == 4096);
  CHECK(g2.max_window_layers == 0);
  const llm::DecoderConfig g2b = parse("gemma2", R"(, "head_dim": 16, "query_pre_attn_scalar": 24,
      "attn_logit_softcapping": null, "final_logit_softcapping": 2.5, "sliding_window": null,
      "tie_word_embeddings": false, "attention_bias": true)");
  CHECK(g2b.attention_scale() == doctest::Approx(1 / std::sqrt(24.0)).epsilon(1e-15));
  CHECK(g2b.attn_logit_softcapping == 0);
  CHECK(g2b.final_logit_softcapping == 2.5);
  CHECK(g2b.sliding_window == 0);
  CHECK_FALSE(g2b.tie_word_embeddings);
  CHECK((g2b.qkv_bias && g2b.o_bias && !g2b.mlp_bias));
  // The four norms a layer: 2 x 48 more per layer than gemma's two.
  CHECK(g2.parameter_count() - parse("gemma", R"(, "num_key_value_heads": 4)").parameter_count() ==
        3 * 2 * 48);
  // Activations: Gemma's published "gelu" is the tanh approximation in both
  // generations of transformers; 4.x's hidden_activation wins where set.
  CHECK(parse("gemma", R"(, "hidden_act": "gelu")").hidden_act == llm::GatedAct::gelu_tanh);
  CHECK(parse("gemma", R"(, "hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh")")
            .hidden_act == llm::GatedAct::gelu_tanh);
  CHECK_THROWS_WITH(parse("gemma", R"(, "hidden_act": "silu")"),
                    doctest::Contains("hidden_act \"silu\" is not supported (gelu_pytorch_tanh"));
  // Gemma 2 reads hidden_activation alone, where "gelu" is the exact GELU.
  CHECK(parse("gemma2", R"(, "hidden_act": "silu")").hidden_act == llm::GatedAct::gelu_tanh);
  CHECK_THROWS_WITH(parse("gemma2", R"(, "hidden_activation": "gelu")"),
                    doctest::Contains("hidden_activation \"gelu\" is not supported"));
  CHECK_THROWS_WITH(parse("llama", R"(, "hidden_act": "gelu_pytorch_tanh")"),
                    doctest::Contains("hidden_act \"gelu_pytorch_tanh\" is not supported (silu)"));
  CHECK_THROWS_WITH(parse("gemma2", R"(, "attn_logit_softcapping": 0)"),
                    doctest::Contains("\"attn_logit_softcapping\" must be a number > 0 or null"));
  CHECK_THROWS_WITH(parse("gemma", R"(, "use_bidirectional_attention": true)"),
                    doctest::Contains("use_bidirectional_attention"));
  // layer_types: any pattern of the two kinds, gemma2's alternation when
  // absent.
  CHECK(g2.sliding_layers == std::vector<bool>{true, false, true});
  const llm::DecoderConfig listed = parse("gemma2", R"(, "layer_types": ["full_attention",
      "full_attention", "sliding_attention"])");
  CHECK(listed.sliding_layers == std::vector<bool>{false, false, true});
  CHECK(listed.layer_window(2) == 4096);
  CHECK(listed.layer_window(0) == 0);
  CHECK_THROWS_WITH(parse("gemma2", R"(, "layer_types": ["full_attention", "chunked_attention",
      "sliding_attention"])"),
                    doctest::Contains("\"layer_types\"[1] is \"chunked_attention\""));
  // Written back and read again: the same model.
  for (const llm::DecoderConfig& d : {g, g2, g2b}) {
    CAPTURE(d.model_type);
    const llm::DecoderConfig again =
        llm::parse_decoder_config(llm::decoder_config_json(d), "written.json");
    CHECK(again.model_type == d.model_type);
    CHECK(again.head_dim == d.head_dim);
    CHECK(again.num_key_value_heads == d.num_key_value_heads);
    CHECK(again.hidden_act == d.hidden_act);
    CHECK(again.tie_word_embeddings == d.tie_word_embeddings);
    CHECK(again.query_pre_attn_scalar == d.query_pre_attn_scalar);
    CHECK(again.attn_logit_softcapping == d.attn_logit_softcapping);
    CHECK(again.final_logit_softcapping == d.final_logit_softcapping);
    CHECK(again.sliding_window == d.sliding_window);
    CHECK(again.sliding_layers == d.sliding_layers);
    CHECK(again.qkv_bias == d.qkv_bias);
    CHECK(again.parameter_count() == d.parameter_count());
  }
}

// What Gemma3TextConfig in transformers 5.24 makes of 4.x's keys (as the
// Gemma 3 1B and 270M folders on the Hub carry them) and of 5.x's.
TEST_CASE("decoder configs: gemma3_text, its layer types and their RoPE") {
  const auto parse = [](const std::string& extra) {
    return small_config("gemma3_text", 48, 7, extra);
  };
  // Defaults: Gemma 2's layout, q and k norms, no caps, all but every 6th
  // layer sliding over 4096 keys, RoPE 1e6 for full layers, 10000 for
  // sliding ones.
  const llm::DecoderConfig d = parse("");
  CHECK(d.qk_norm);
  CHECK(d.gemma_norms);
  CHECK(d.sandwich_norms);
  CHECK(d.hidden_act == llm::GatedAct::gelu_tanh);
  CHECK(d.head_dim == 256);
  CHECK(d.num_key_value_heads == 4);
  CHECK(d.attn_logit_softcapping == 0);
  CHECK(d.final_logit_softcapping == 0);
  CHECK(d.sliding_window == 4096);
  CHECK(d.sliding_layers == std::vector<bool>{true, true, true, true, true, false, true});
  CHECK(d.rope.theta == 1e6);
  REQUIRE(d.sliding_rope.has_value());
  CHECK(d.sliding_rope->theta == 10000);
  CHECK(d.sliding_rope->scaling.type == "default");
  // 4.x names: rope_theta and rope_scaling for the full layers,
  // rope_local_base_freq for the sliding ones, sliding_window_pattern.
  const llm::DecoderConfig v4 = parse(R"(, "rope_theta": 500000.0, "rope_local_base_freq": 20000.0,
      "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
      "sliding_window_pattern": 3)");
  CHECK(v4.rope.theta == 500000);
  CHECK(v4.rope.scaling.type == "linear");
  CHECK(v4.rope.scaling.factor == 8);
  CHECK(v4.sliding_rope->theta == 20000);
  CHECK(v4.sliding_rope->scaling.type == "default");
  CHECK(v4.sliding_window == 512);
  CHECK(v4.sliding_layers == std::vector<bool>{true, true, false, true, true, false, true});
  // 5.x names: rope_parameters per layer type.
  const llm::DecoderConfig v5 = parse(R"(, "rope_parameters": {
      "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
      "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
      "full_attention", "sliding_attention", "full_attention", "full_attention"],
      "sliding_window": null)");
  CHECK(v5.rope.scaling.factor == 2);
  CHECK(v5.sliding_rope->theta == 10000);
  CHECK(v5.sliding_window == 0);
  // Without a window the sliding layers keep their RoPE (layer_slides).
  CHECK(v5.layer_slides(0));
  CHECK(v5.layer_window(0) == 0);
  CHECK_FALSE(v5.layer_slides(1));
  // Written back (both generations of names) and read again.
  for (const llm::DecoderConfig& c : {d, v4, v5}) {
    const llm::DecoderConfig again =
        llm::parse_decoder_config(llm::decoder_config_json(c), "written.json");
    CHECK(again.model_type == "gemma3_text");
    CHECK(again.rope.theta == c.rope.theta);
    CHECK(again.rope.scaling.type == c.rope.scaling.type);
    CHECK(again.rope.scaling.factor == c.rope.scaling.factor);
    CHECK(again.sliding_rope->theta == c.sliding_rope->theta);
    CHECK(again.sliding_window == c.sliding_window);
    CHECK(again.sliding_layers == c.sliding_layers);
    CHECK(again.qk_norm);
    CHECK(again.parameter_count() == c.parameter_count());
  }
  // Per-layer-type RoPE belongs to Gemma 3 only.
  CHECK_THROWS_WITH(
      llm::parse_decoder_config(R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
          "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
          "max_position_embeddings": 32, "rope_parameters": {"full_attention": {}}})",
                                "cfg.json"),
      doctest::Contains("per-layer-type \"rope_parameters\" are not supported"));
}

// Gemma 3's image-text config (Gemma3ForConditionalGeneration): its decoder
// is text_config, filled with Gemma3TextConfig's defaults as transformers
// 5.24 fills it; the rest is kept for the folders written from it.
TEST_CASE("decoder configs: gemma3's image-text config, its decoder under text_config") {
  const llm::DecoderConfig d = llm::parse_decoder_config(
      R"({"model_type": "gemma3", "torch_dtype": "bfloat16", "mm_tokens_per_image": 256,
          "text_config": {"hidden_size": 64, "num_hidden_layers": 7, "sliding_window": 32,
                          "final_logit_softcapping": 30.0},
          "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 16}})",
      "cfg.json");
  CHECK(d.model_type == "gemma3_text");
  CHECK(d.decoder_module() == "model.language_model");
  CHECK(d.vocab_size == 262208);
  CHECK(d.intermediate_size == 9216);
  CHECK(d.num_attention_heads == 8);
  CHECK(d.num_key_value_heads == 4);
  CHECK(d.head_dim == 256);
  CHECK(d.max_position_embeddings == 131072);
  CHECK(d.dtype == DType::bf16);  // the outer config's
  CHECK(d.tie_word_embeddings);
  CHECK(d.sliding_window == 32);
  CHECK(d.sliding_layers == std::vector<bool>{true, true, true, true, true, false, true});
  // The image-text class never caps its logits, whatever text_config says.
  CHECK(d.final_logit_softcapping == 0);
  // Written back: the outer config around the decoder's, read again alike.
  const std::string written = llm::decoder_config_json(d);
  const nlohmann::json j = nlohmann::json::parse(written);
  CHECK(j.at("model_type") == "gemma3");
  CHECK(j.at("mm_tokens_per_image") == 256);
  CHECK(j.at("vision_config").at("hidden_size") == 16);
  CHECK(j.at("text_config").at("model_type") == "gemma3_text");
  CHECK(j.at("torch_dtype") == "bfloat16");
  const llm::DecoderConfig again = llm::parse_decoder_config(written, "written.json");
  CHECK(again.image_text_config == d.image_text_config);
  CHECK(again.vocab_size == d.vocab_size);
  CHECK(again.sliding_layers == d.sliding_layers);
  CHECK(again.rope.theta == d.rope.theta);
  CHECK(again.sliding_rope->theta == d.sliding_rope->theta);
  CHECK(again.parameter_count() == d.parameter_count());
  // A text-only folder has no image-text part.
  CHECK(llm::parse_decoder_config(llm::decoder_config_json(tiny_config(DType::f32)), "t.json")
            .decoder_module() == "model");
  // Errors name text_config's keys.
  CHECK_THROWS_WITH(llm::parse_decoder_config(
                        R"({"model_type": "gemma3", "text_config": {"head_dim": 3}})", "cfg.json"),
                    doctest::Contains("cfg.json text_config: head_dim must be even"));
  CHECK_THROWS_WITH(
      llm::parse_decoder_config(
          R"({"model_type": "gemma3", "text_config": {"model_type": "llama"}})", "cfg.json"),
      doctest::Contains("text_config's model_type is \"llama\""));
  CHECK_THROWS_WITH(
      llm::parse_decoder_config(R"({"model_type": "gemma3", "text_config": 3})", "cfg.json"),
      doctest::Contains("\"text_config\" must be an object"));
}

// Sliding windows are computed (the transformers parity above holds
// mistral_window and qwen2_window, windows of 4 and 5 over 12 tokens): a KV
// cache continues a windowed sequence as the full forward does, token by
// token past the window, and a window no sequence fills is full attention.
TEST_CASE("CausalLM: a sliding window through a KV cache and generation") {
  const std::string dir = data_dir() + "/models/mistral_window";
  auto model = llm::load_causal_lm(dir);
  REQUIRE(model->config().sliding_window == 4);
  CHECK(model->config().layer_window(0) == 4);
  CHECK(model->config().layer_window(1) == 4);
  NoGradGuard no_grad;
  const std::vector<int64_t> seq = {4, 8, 15, 16, 23, 42, 7, 1, 9, 30};
  const Tensor full = model->logits(from_vector<int64_t>(seq, {1, 10}));
  llm::KVCache cache;
  const Tensor head = model->logits(from_vector<int64_t>({4, 8, 15}, {1, 3}), &cache);
  CHECK(max_rel_diff(head, slice(full, 1, 0, 3)) < 1e-6);
  for (int64_t t = 3; t < 10; ++t) {
    CAPTURE(t);
    const Tensor step = model->logits(from_vector<int64_t>({seq[t]}, {1, 1}), &cache);
    CHECK(max_rel_diff(step, slice(full, 1, t, t + 1)) < 1e-6);
  }
  // Generation past the window equals greedy decoding of full forwards.
  const std::vector<int64_t> got = llm::generate(*model, {4, 8, 15}, {.max_new_tokens = 7});
  std::vector<int64_t> want = {4, 8, 15};
  for (int i = 0; i < 7; ++i) {
    const Tensor l = model->logits(from_vector<int64_t>(want, {1, int64_t(want.size())}));
    want.push_back(
        argmax(select(select(l, 0, 0), 0, int64_t(want.size()) - 1), 0).to_vector<int64_t>()[0]);
  }
  CHECK(got == std::vector<int64_t>(want.begin() + 3, want.end()));
  // A window longer than every sequence is full attention.
  llm::DecoderConfig wide = model->config();
  wide.sliding_window = 64;
  llm::DecoderConfig none = model->config();
  none.sliding_window = 0;
  none.sliding_layers.clear();
  const StateDict weights = llm::read_model_weights(dir);
  llm::CausalLM a(wide, weights), b(none, weights);
  const Tensor ids = from_vector<int64_t>(seq, {1, 10});
  CHECK(a.logits(ids).to_vector<float>() == b.logits(ids).to_vector<float>());
}

TEST_CASE(
    "decoder configs: the published configs of Llama 3.2 1B, TinyLlama, SmolLM2, Qwen2.5, "
    "Qwen3, Gemma 2, Gemma 3, Phi-3 and Phi-4-mini") {
  struct Published {
    const char* file;
    const char* type;
    int64_t heads, kv_heads, head_dim, parameters;
    bool tied;
    const char* rope;
  };
  // Parameter counts as the hub lists them: the config's shapes add up to them.
  const Published models[] = {
      {"llama-3.2-1b.json", "llama", 32, 8, 64, 1235814400, true, "llama3"},
      {"tinyllama-1.1b-chat-v1.0.json", "llama", 32, 4, 64, 1100048384, false, "default"},
      {"smollm2-135m.json", "llama", 9, 3, 64, 134515008, true, "default"},
      {"qwen2.5-0.5b.json", "qwen2", 14, 2, 64, 494032768, true, "default"},
      // 0.44B without the embeddings, as its model card says.
      {"qwen3-0.6b.json", "qwen3", 16, 8, 128, 596049920, true, "default"},
      {"gemma-2-9b-it.json", "gemma2", 16, 8, 256, 9241705984, true, "default"},
      {"gemma-3-1b-it.json", "gemma3_text", 4, 1, 256, 999885952, true, "default"},
      // The decoder of the 4B's 4,300,079,472 (the rest is its vision tower).
      {"gemma-3-4b-it.json", "gemma3_text", 8, 4, 256, 3880263168, true, "linear"},
      {"phi-3-mini-4k-instruct.json", "phi3", 32, 32, 96, 3821079552, false, "default"},
      {"phi-4-mini-instruct.json", "phi3", 24, 8, 128, 3836021760, true, "longrope"},
  };
  for (const Published& m : models) {
    INFO("config ", m.file);
    const llm::DecoderConfig c = llm::read_decoder_config(data_dir() + "/configs/" + m.file);
    CHECK(c.model_type == m.type);
    CHECK(c.num_attention_heads == m.heads);
    CHECK(c.num_key_value_heads == m.kv_heads);
    CHECK(c.head_dim == m.head_dim);
    CHECK(c.tie_word_embeddings == m.tied);
    CHECK(c.dtype == DType::bf16);
    CHECK(c.rope.scaling.type == m.rope);
    CHECK(c.parameter_count() == m.parameters);
    CHECK(c.qkv_bias == (std::string(m.type) == "qwen2"));
    CHECK(c.qk_norm == (std::string(m.type) == "qwen3" || std::string(m.type) == "gemma3_text"));
    // The shapes CausalLM expects are the ones those checkpoints hold.
    int64_t total = 0;
    for (const auto& [name, shape] : llm::CausalLM::expected_weights(c)) total += numel_of(shape);
    CHECK(total == m.parameters);
  }
  const llm::DecoderConfig llama =
      llm::read_decoder_config(data_dir() + "/configs/llama-3.2-1b.json");
  CHECK(llama.rope.theta == 500000.0);
  CHECK(llama.rope.scaling.factor == 32.0);
  CHECK(llama.rope.scaling.original_max_position_embeddings == 8192);
  CHECK(llama.max_position_embeddings == 131072);
  // Gemma 2 9B: caps 50 and 30, every other layer over 4096 keys.
  const llm::DecoderConfig g2 =
      llm::read_decoder_config(data_dir() + "/configs/gemma-2-9b-it.json");
  CHECK(g2.attn_logit_softcapping == 50);
  CHECK(g2.final_logit_softcapping == 30);
  CHECK(g2.sliding_window == 4096);
  CHECK(g2.layer_window(0) == 4096);
  CHECK(g2.layer_window(1) == 0);
  CHECK(g2.hidden_act == llm::GatedAct::gelu_tanh);
  // Gemma 3 1B: windows of 512 but on every sixth layer, whose RoPE is 1e6
  // where the sliding ones' is 10000.
  const llm::DecoderConfig g3 =
      llm::read_decoder_config(data_dir() + "/configs/gemma-3-1b-it.json");
  int64_t full = 0;
  for (int64_t l = 0; l < g3.num_hidden_layers; ++l) full += g3.layer_window(l) == 0;
  CHECK(full == 4);  // layers 5, 11, 17, 23
  CHECK(g3.layer_window(5) == 0);
  CHECK(g3.layer_window(0) == 512);
  CHECK(g3.rope.theta == 1e6);
  CHECK(g3.sliding_rope->theta == 10000);
  CHECK(g3.attn_logit_softcapping == 0);
  // Gemma 3 4B: its text_config names a few keys, the defaults the rest;
  // windows of 1024 on 29 layers of 34.
  const llm::DecoderConfig g4 =
      llm::read_decoder_config(data_dir() + "/configs/gemma-3-4b-it.json");
  CHECK(g4.decoder_module() == "model.language_model");
  CHECK(g4.vocab_size == 262208);
  CHECK(g4.num_hidden_layers == 34);
  int64_t sliding = 0;
  for (int64_t l = 0; l < g4.num_hidden_layers; ++l) sliding += g4.layer_window(l) == 1024;
  CHECK(sliding == 29);
  CHECK(g4.rope.scaling.factor == 8);
  CHECK(g4.sliding_rope->scaling.type == "default");
  // Phi-3-mini: fused projections, a window of 2047 on every layer.
  const llm::DecoderConfig p3 =
      llm::read_decoder_config(data_dir() + "/configs/phi-3-mini-4k-instruct.json");
  CHECK(p3.fused_projections);
  CHECK(p3.layer_window(0) == 2047);
  CHECK(p3.layer_window(31) == 2047);
  CHECK(p3.rope.head_dim == 96);
  // Phi-4-mini: 96 of each head's 128 values rotated, longrope past 4096
  // positions (factor 131072 / 4096, so cos and sin scaled by 1.1902).
  const llm::DecoderConfig p4 =
      llm::read_decoder_config(data_dir() + "/configs/phi-4-mini-instruct.json");
  CHECK(p4.rope.head_dim == 96);
  CHECK(p4.rope.scaling.original_max_position_embeddings == 4096);
  CHECK(p4.rope.scaling.long_factor.size() == 48);
  CHECK(p4.rope.scaling.long_factor.back() == 47.77);
  const llm::RopeFrequencies short_f = llm::rope_frequencies(p4.rope, 4096);
  const llm::RopeFrequencies long_f = llm::rope_frequencies(p4.rope, 4097);
  CHECK(short_f.attention_scaling == doctest::Approx(1.1902380714238083).epsilon(1e-15));
  CHECK(long_f.inv_freq.back() == doctest::Approx(short_f.inv_freq.back() / 47.77).epsilon(1e-6));
  // Written back and read again: the same RoPE.
  const llm::DecoderConfig again =
      llm::parse_decoder_config(llm::decoder_config_json(p4), "written.json");
  CHECK(again.rope.head_dim == 96);
  CHECK(again.rope.scaling.type == "longrope");
  CHECK(again.rope.scaling.short_factor == p4.rope.scaling.short_factor);
  CHECK(again.rope.scaling.long_factor == p4.rope.scaling.long_factor);
  CHECK(again.rope.scaling.original_max_position_embeddings == 4096);
  CHECK(llm::rope_frequencies(again.rope, 5000).attention_scaling == long_f.attention_scaling);
  CHECK(again.fused_projections);
  CHECK(again.sliding_window == 262144);
  CHECK(again.parameter_count() == 3836021760);
}

// What Olmo2Config in transformers 5.24 reads: Llama's keys, its q and k
// norms over all heads, its norms after each block.
TEST_CASE("decoder configs: olmo2") {
  const llm::DecoderConfig d =
      small_config("olmo2", 64, 2, R"(, "num_key_value_heads": 2, "attention_bias": true)");
  CHECK(d.qk_norm);
  CHECK(d.qk_norm_whole);
  CHECK(d.post_norms);
  CHECK_FALSE(d.sandwich_norms);
  CHECK(d.qkv_bias);
  CHECK(d.norm_weight() == llm::RmsWeight::in_accumulation);
  CHECK(small_config("llama", 64, 2, "").norm_weight() == llm::RmsWeight::rounded_first);
  // The names and shapes its checkpoints hold: no input_layernorm, q and k
  // norms as wide as q (4 heads x 16) and k (2 x 16).
  std::map<std::string, Shape> shapes;
  for (const auto& [name, shape] : llm::CausalLM::expected_weights(d)) shapes[name] = shape;
  CHECK(shapes.count("model.layers.0.input_layernorm.weight") == 0);
  CHECK(shapes.at("model.layers.0.post_feedforward_layernorm.weight") == Shape{64});
  CHECK(shapes.at("model.layers.0.self_attn.q_norm.weight") == Shape{64});
  CHECK(shapes.at("model.layers.0.self_attn.k_norm.weight") == Shape{32});
  int64_t total = 0;
  for (const auto& [name, shape] : shapes) total += numel_of(shape);
  CHECK(total == d.parameter_count());
  const llm::DecoderConfig again =
      llm::parse_decoder_config(llm::decoder_config_json(d), "written.json");
  CHECK(again.model_type == "olmo2");
  CHECK(again.qkv_bias);
  CHECK(again.parameter_count() == d.parameter_count());
}

// What transformers 5.24's Olmo3Config makes of the keys: OLMo 2's layout,
// a window of 4096 on all but every 4th layer, theta 500000 on both layer
// types, a 4.x rope_scaling on the full layers only.
TEST_CASE("decoder configs: olmo3, its layer types and their RoPE") {
  const llm::DecoderConfig d = small_config("olmo3", 64, 8, "");
  CHECK(d.qk_norm_whole);
  CHECK(d.post_norms);
  CHECK(d.norm_weight() == llm::RmsWeight::in_accumulation);
  CHECK(d.rms_norm_eps == 1e-5);
  CHECK_FALSE(d.tie_word_embeddings);
  CHECK(d.sliding_window == 4096);
  for (int64_t l = 0; l < 8; ++l) CHECK(d.layer_slides(l) == ((l + 1) % 4 != 0));
  CHECK(d.rope.theta == 5e5);
  REQUIRE(d.sliding_rope);
  CHECK(d.sliding_rope->theta == 5e5);
  const llm::DecoderConfig y = small_config(
      "olmo3", 64, 2,
      R"(, "rope_theta": 1000.0, "sliding_window": null, "layer_types": ["sliding_attention",
          "full_attention"], "rope_scaling": {"rope_type": "yarn", "factor": 8.0,
          "original_max_position_embeddings": 16})");
  CHECK(y.sliding_window == 0);
  CHECK(y.layer_slides(0));  // its type, for the RoPE, without a window
  CHECK(y.layer_window(0) == 0);
  CHECK(y.rope.scaling.type == "yarn");
  CHECK(y.rope.theta == 1000.0);
  CHECK(y.sliding_rope->scaling.type == "default");
  CHECK(y.sliding_rope->theta == 1000.0);
  const llm::DecoderConfig again =
      llm::parse_decoder_config(llm::decoder_config_json(y), "written.json");
  CHECK(again.model_type == "olmo3");
  CHECK(again.layer_slides(0));
  CHECK_FALSE(again.layer_slides(1));
  CHECK(again.rope.scaling.type == "yarn");
  CHECK(again.rope.scaling.original_max_position_embeddings == 16);
  CHECK(again.sliding_rope->scaling.type == "default");
  CHECK(again.sliding_rope->theta == 1000.0);
  CHECK_THROWS_WITH(small_config("olmo3", 64, 2, R"(, "layer_types": ["sliding_attention"])"),
                    doctest::Contains("\"layer_types\" must list one type per layer (2)"));
}

// What transformers 5.24's SmolLM3Config makes of the keys: every 4th layer
// without RoPE unless no_rope_layers says, 4 key heads, tied, theta 2e6,
// windows only with use_sliding_window (on the NoPE layers by default).
TEST_CASE("decoder configs: smollm3, its NoPE layers and windows") {
  const llm::DecoderConfig d = small_config("smollm3", 64, 8, "");
  CHECK(d.num_key_value_heads == 4);
  CHECK(d.tie_word_embeddings);
  CHECK(d.rope.theta == 2e6);
  CHECK(d.rms_norm_eps == 1e-6);
  CHECK(d.sliding_window == 0);
  for (int64_t l = 0; l < 8; ++l) CHECK(d.layer_rotates(l) == ((l + 1) % 4 != 0));
  CHECK(small_config("smollm3", 64, 4, R"(, "no_rope_layer_interval": 2)").layer_rotates(1) ==
        false);
  const llm::DecoderConfig w = small_config(
      "smollm3", 64, 3,
      R"(, "no_rope_layers": [1, 0, 1, 1], "use_sliding_window": true, "sliding_window": 8,
          "attention_bias": true, "mlp_bias": true)");
  CHECK_FALSE(w.layer_rotates(1));
  CHECK(w.layer_rotates(2));
  CHECK(w.layer_window(1) == 8);  // the NoPE layer slides
  CHECK(w.layer_window(0) == 0);
  CHECK(w.qkv_bias);
  CHECK(w.mlp_bias);
  const llm::DecoderConfig again =
      llm::parse_decoder_config(llm::decoder_config_json(w), "written.json");
  CHECK(again.model_type == "smollm3");
  CHECK(again.nope_layers == w.nope_layers);
  CHECK(again.sliding_layers == w.sliding_layers);
  CHECK(again.layer_window(1) == 8);
  CHECK(again.mlp_bias);
  // Every layer rotating: no NoPE layers kept.
  CHECK(small_config("smollm3", 64, 2, R"(, "no_rope_layers": [1, 1])").nope_layers.empty());
  CHECK_THROWS_WITH(small_config("smollm3", 64, 3, R"(, "no_rope_layers": [1, 0])"),
                    doctest::Contains("\"no_rope_layers\" must list 1 (RoPE) or 0 (none) for "
                                      "each of the 3 layers"));
  CHECK_THROWS_WITH(small_config("smollm3", 64, 2, R"(, "no_rope_layers": [1, 2])"),
                    doctest::Contains("\"no_rope_layers\"[1] is 2 (1 or 0)"));
  CHECK_THROWS_WITH(
      small_config("smollm3", 64, 2,
                   R"(, "layer_types": ["full_attention", "sliding_attention"],
                       "sliding_window": 8)"),
      doctest::Contains("names sliding_attention layers but use_sliding_window is not true"));
}

// What transformers 5.24's GraniteConfig makes of the keys: Llama's, with
// four scalings (1 by default: the scores then unscaled by head_dim).
TEST_CASE("decoder configs: granite, its multipliers") {
  const llm::DecoderConfig d = small_config("granite", 64, 2, "");
  CHECK(d.embedding_multiplier == 1);
  CHECK(d.residual_multiplier == 1);
  CHECK(d.logits_scaling == 1);
  CHECK(d.attention_scale() == 1.0);
  CHECK(d.num_key_value_heads == 4);
  CHECK_FALSE(d.tie_word_embeddings);
  // Granite 3.3 8B's values.
  const llm::DecoderConfig g =
      small_config("granite", 64, 2,
                   R"(, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
          "attention_multiplier": 0.0078125, "logits_scaling": 16.0, "attention_bias": true,
          "mlp_bias": true)");
  CHECK(g.embedding_multiplier == 12.0);
  CHECK(g.residual_multiplier == 0.22);
  CHECK(g.attention_scale() == 0.0078125);
  CHECK(g.logits_scaling == 16.0);
  CHECK(g.qkv_bias);
  CHECK(g.mlp_bias);
  const llm::DecoderConfig again =
      llm::parse_decoder_config(llm::decoder_config_json(g), "written.json");
  CHECK(again.model_type == "granite");
  CHECK(again.residual_multiplier == 0.22);
  CHECK(again.attention_scale() == 0.0078125);
  CHECK(again.logits_scaling == 16.0);
  CHECK(again.embedding_multiplier == 12.0);
  CHECK(again.mlp_bias);
  CHECK_THROWS_WITH(small_config("granite", 64, 2, R"(, "logits_scaling": 0)"),
                    doctest::Contains("\"logits_scaling\" must be a number > 0, got 0"));
  // Other model types do not read the keys, as their classes do not.
  CHECK(small_config("llama", 64, 2, R"(, "logits_scaling": 16.0)").logits_scaling == 1);
}

// What transformers 5.24's MinistralConfig makes of the keys: Mistral's,
// with layer types (by default every layer sliding over 4096, none when
// sliding_window is null).
TEST_CASE("decoder configs: ministral, its layer types") {
  CHECK_THROWS_WITH(small_config("ministral", 64, 2, ""),
                    doctest::Contains("num_key_value_heads 8 (the key is absent: transformers' "
                                      "default for ministral)"));
  const llm::DecoderConfig d = small_config("ministral", 64, 2, R"(, "num_key_value_heads": 2)");
  CHECK(d.sliding_window == 4096);
  CHECK(d.layer_slides(0));
  CHECK(d.layer_slides(1));
  CHECK(small_config("ministral", 64, 2, R"(, "num_key_value_heads": 2, "sliding_window": null)")
            .sliding_window == 0);
  const llm::DecoderConfig t = small_config(
      "ministral", 64, 2,
      R"(, "num_key_value_heads": 2, "sliding_window": 8, "layer_types": ["full_attention",
          "sliding_attention"])");
  CHECK(t.layer_window(0) == 0);
  CHECK(t.layer_window(1) == 8);
  const llm::DecoderConfig again =
      llm::parse_decoder_config(llm::decoder_config_json(t), "written.json");
  CHECK(again.model_type == "ministral");
  CHECK(again.sliding_layers == t.sliding_layers);
  CHECK(again.sliding_window == 8);
}

// What transformers 5.24's Exaone4Config makes of the keys: OLMo 2's norms
// after each block, Qwen3's per-head q and k norms (Llama's rounding), all
// but every sliding_window_pattern-th layer sliding (4096 over every 4th by
// default), and with a window the full layers without RoPE.
TEST_CASE("decoder configs: exaone4, its windows and NoPE full layers") {
  const llm::DecoderConfig d = small_config("exaone4", 64, 8, R"(, "num_key_value_heads": 2)");
  CHECK(d.post_norms);
  CHECK(d.qk_norm);
  CHECK_FALSE(d.qk_norm_whole);
  CHECK(d.norm_weight() == llm::RmsWeight::rounded_first);
  CHECK(d.rms_norm_eps == 1e-5);
  CHECK(d.sliding_window == 4096);
  for (int64_t l = 0; l < 8; ++l) {
    CAPTURE(l);
    CHECK(d.layer_slides(l) == ((l + 1) % 4 != 0));
    CHECK(d.layer_rotates(l) == d.layer_slides(l));
  }
  CHECK_THROWS_WITH(small_config("exaone4", 64, 2, ""),
                    doctest::Contains("num_key_value_heads 32 (the key is absent"));
  // No window: every layer full, every layer rotating.
  const llm::DecoderConfig full =
      small_config("exaone4", 64, 4, R"(, "num_key_value_heads": 2, "sliding_window": null)");
  CHECK(full.sliding_window == 0);
  CHECK(full.nope_layers.empty());
  for (int64_t l = 0; l < 4; ++l) CHECK_FALSE(full.layer_slides(l));
  const llm::DecoderConfig p = small_config(
      "exaone4", 64, 4,
      R"(, "num_key_value_heads": 2, "sliding_window": 16, "sliding_window_pattern": 2)");
  CHECK(p.layer_window(0) == 16);
  CHECK(p.layer_window(1) == 0);
  CHECK_FALSE(p.layer_rotates(1));
  const llm::DecoderConfig again =
      llm::parse_decoder_config(llm::decoder_config_json(p), "written.json");
  CHECK(again.model_type == "exaone4");
  CHECK(again.sliding_layers == p.sliding_layers);
  CHECK(again.nope_layers == p.nope_layers);
  CHECK_THROWS_WITH(
      small_config("exaone4", 64, 4,
                   R"(, "num_key_value_heads": 2, "sliding_window_pattern": "LLLG")"),
      doctest::Contains("\"sliding_window_pattern\" other than a number needs \"layer_types\""));
}

// The class defaults of rms_norm_eps where config.json has none: Phi-3's
// and OLMo's 1e-5, the others' 1e-6.
TEST_CASE("decoder configs: rms_norm_eps defaults per model type") {
  const auto eps = [](const char* type) {
    return small_config(type, 64, 2, R"(, "num_key_value_heads": 2)").rms_norm_eps;
  };
  for (const char* type : {"phi3", "olmo2", "olmo3", "exaone4"}) CHECK(eps(type) == 1e-5);
  for (const char* type : {"llama", "mistral", "qwen2", "qwen3", "gemma", "smollm3"})
    CHECK(eps(type) == 1e-6);
}

TEST_CASE("decoder configs: phi3, its fused projections, partial rotary and longrope") {
  const auto parse = [](const std::string& extra) { return small_config("phi3", 64, 2, extra); };
  // Phi3Config's defaults: key heads = heads, no window, untied, full rotary.
  const llm::DecoderConfig d = parse("");
  CHECK(d.fused_projections);
  CHECK(d.num_key_value_heads == 4);
  CHECK(d.sliding_window == 0);
  CHECK_FALSE(d.tie_word_embeddings);
  CHECK(d.rope.head_dim == 16);
  CHECK(d.rope.scaling.type == "default");
  // Its early checkpoints' names for longrope ("su", "yarn"); the top-level
  // original_max_position_embeddings wins over the object's, as in
  // transformers (Phi3Config's 4096 where absent).
  const std::string factors =
      R"("short_factor": [1, 1, 1, 1, 1, 1], "long_factor": [1, 2, 3, 4, 5, 6])";
  for (const char* type : {"su", "yarn", "longrope"}) {
    const llm::DecoderConfig l = parse(
        std::string(R"(, "partial_rotary_factor": 0.75, "original_max_position_embeddings": 16,
            "rope_scaling": {"type": ")") +
        type + R"(", "original_max_position_embeddings": 32, )" + factors + "}");
    CHECK(l.rope.scaling.type == "longrope");
    CHECK(l.rope.head_dim == 12);
    CHECK(l.rope.scaling.original_max_position_embeddings == 16);
  }
  CHECK(parse(R"(, "partial_rotary_factor": 0.75, "rope_scaling": {"type": "longrope", )" +
              factors + "}")
            .rope.scaling.original_max_position_embeddings == 4096);
  // Refused, each naming the key.
  CHECK_THROWS_WITH(parse(R"(, "resid_pdrop": 0.1)"),
                    doctest::Contains("\"resid_pdrop\": 0.1 is not supported"));
  CHECK_THROWS_WITH(parse(R"(, "rope_scaling": {"type": "longrope", "short_factor": [1]})"),
                    doctest::Contains("longrope needs \"long_factor\""));
  CHECK_THROWS_WITH(
      parse(
          R"(, "partial_rotary_factor": 0.75, "rope_scaling": {"type": "longrope", "short_factor": [1, 2, 3, 4, 5, 6], "long_factor": [1, 2, 3, 4, 5]})"),
      doctest::Contains("cfg.json: [rope] longrope's long_factor has 5 values"));
  CHECK_THROWS_WITH(parse(R"(, "partial_rotary_factor": 0.3125)"),
                    doctest::Contains("must rotate an even number of values"));
  CHECK_THROWS_WITH(
      llm::parse_decoder_config(R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
          "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
          "max_position_embeddings": 32, "partial_rotary_factor": 0.5})",
                                "cfg.json"),
      doctest::Contains("\"partial_rotary_factor\" other than 1 is not supported (phi3 only)"));
}
