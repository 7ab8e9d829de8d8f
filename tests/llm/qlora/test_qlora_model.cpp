// QLoRA on a CausalLM without fixtures: which layers PEFT's target_modules
// select, what apply_qlora converts and freezes, its refusals, adapter
// folders written and read back (and refused when they do not fit), and a
// merged model equal to the adapted one.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "../ops/op_fixtures.h"
#include "engine/autograd/grad_mode.h"
#include "engine/capture/device_graph.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/optim/optimizer.h"
#include "llm/model/lm_loss.h"
#include "llm/model/model_folder.h"
#include "llm/qlora/peft_folder.h"
#include "llm/qlora/qlora_model.h"
#include "support/gpu.h"
#include "support/temp_dir.h"
#include "support/test_data.h"

using namespace quanta;
using namespace quanta::testing;
namespace fs = std::filesystem;

namespace {

std::string model_dir(const std::string& name) {
  return quanta::testing::test_data("llm/models/" + name);
}

llm::QLoRAOptions options(std::vector<std::string> targets, int64_t r = 4) {
  llm::QLoRAOptions o;
  o.lora.r = r;
  o.lora.lora_alpha = 8;
  o.lora.target_modules = std::move(targets);
  o.quantization.compute_dtype = DType::f32;
  o.seed = 3;
  return o;
}

// Gives every lora_B values (and DoRA's magnitudes others than the rows'
// norms), so that the adapters change the output.
void perturb_adapters(Module& model) {
  NoGradGuard no_grad;
  Generator gen(11);
  for (auto& [name, layer] : llm::lora_layers(model)) {
    copy_(layer->lora_B(), randn(layer->lora_B().shape(), gen) * 0.05);
    if (layer->lora_B_bias().defined())
      copy_(layer->lora_B_bias(), randn(layer->lora_B_bias().shape(), gen) * 0.05);
    if (layer->use_dora())
      copy_(
          layer->magnitude(),
          layer->magnitude() *
              (1.0 + randn(layer->magnitude().shape(), gen).to(layer->magnitude().device()) * 0.1));
  }
}

const Tensor kIds = from_vector<int64_t>({1, 5, 9, 2, 7, 3, 30, 41, 12, 0}, {2, 5});

// llama_gqa with adapters on every linear layer (DoRA or not), LoRA dropout
// 0.2 and lora_B perturbed, on `dev`, its layers recomputed in backward or
// not.
std::shared_ptr<llm::CausalLM> dropout_model(Device dev, bool recompute, bool dora = false) {
  std::shared_ptr<llm::CausalLM> model = llm::load_causal_lm(model_dir("llama_gqa"));
  llm::QLoRAOptions o = options({"all-linear"});
  o.lora.lora_dropout = 0.2;
  o.lora.use_dora = dora;
  llm::apply_qlora(*model, o);
  model->to(dev);
  perturb_adapters(*model);
  model->set_recompute_layers(recompute);
  return model;
}

}  // namespace

TEST_CASE("apply_qlora: every linear layer but lm_head in NF4, adapters only where targeted") {
  auto model = llm::load_causal_lm(model_dir("llama_gqa"));
  const llm::QLoRAReport r = llm::apply_qlora(*model, options({"q_proj", "v_proj"}));
  REQUIRE(r.layers.size() == 14);  // 7 projections in each of 2 layers
  int adapted = 0;
  for (const llm::QLoRALayer& l : r.layers) {
    adapted += l.adapted;
    CHECK(l.adapted == (l.name.ends_with("q_proj") || l.name.ends_with("v_proj")));
    // bitsandbytes' layout at block 64 with double quant: 4 bits a weight
    // plus one byte a block (and 4 bytes per 256 blocks).
    CHECK(l.bytes_after < l.bytes_before / 7);
  }
  CHECK(adapted == 4);
  // q_proj: r x 32 + 32 x r; v_proj: r x 32 + 16 x r (2 kv heads of 8).
  CHECK(r.trainable_parameters == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4));
  int64_t trainable = 0;
  for (const auto& [name, p] : model->named_parameters()) {
    INFO(name);
    CHECK(p.requires_grad() == (name.ends_with("lora_A") || name.ends_with("lora_B")));
    trainable += p.requires_grad() ? p.numel() : 0;
  }
  CHECK(trainable == r.trainable_parameters);
  CHECK(model->find("lm_head.weight").dtype() == DType::f32);
  // Each layer draws its own adapters.
  const auto layers = llm::lora_layers(*model);
  REQUIRE(layers.size() == 4);
  CHECK(layers[0].first == "model.layers.0.self_attn.q_proj");
  CHECK(max_rel_diff(layers[0].second->lora_A(), layers[2].second->lora_A()) > 0.1);
  // lora_B starts at zero: the output is the NF4 base's.
  NoGradGuard no_grad;
  CHECK(model->logits(kIds).defined());
}

TEST_CASE("apply_qlora: refusals name the problem and leave the model unchanged") {
  auto model = llm::load_causal_lm(model_dir("llama_gqa"));
  CHECK_THROWS_WITH_AS(llm::apply_qlora(*model, options({"q_proj", "qproj"})),
                       doctest::Contains("\"qproj\" matches no linear layer"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(llm::apply_qlora(*model, options({"lm_head"})),
                       doctest::Contains("\"lm_head\" matches no linear layer"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(llm::apply_qlora(*model, options({"v_proj"}, 17)),
                       doctest::Contains("lora r 17 is larger than layer "
                                         "model.layers.0.self_attn.v_proj allows (16 x 32)"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(llm::apply_qlora(*model, options({"all-linear", "q_proj"})),
                       doctest::Contains("all-linear stands alone"), std::invalid_argument);
  CHECK(llm::lora_layers(*model).empty());
  CHECK(model->find("model.layers.0.self_attn.q_proj.weight").dtype() == DType::f32);
  llm::apply_qlora(*model, options({"all-linear"}));
  CHECK_THROWS_WITH_AS(llm::apply_qlora(*model, options({"all-linear"})),
                       doctest::Contains("already quantized"), std::invalid_argument);
}

TEST_CASE(
    "apply_qlora: modules_to_save trains modules whole, saved and read back with PEFT's names") {
  auto model = llm::load_causal_lm(model_dir("llama_gqa"));
  const auto refused = [&](std::vector<std::string> saved, const char* what,
                           const std::string& name = "llama_gqa") {
    auto m = llm::load_causal_lm(model_dir(name));
    llm::QLoRAOptions o = options({"q_proj"});
    o.lora.modules_to_save = std::move(saved);
    CHECK_THROWS_WITH_AS(llm::apply_qlora(*m, o), doctest::Contains(what), std::invalid_argument);
    CHECK(llm::lora_layers(*m).empty());
  };
  refused({"v_proj"},
          "modules_to_save entry \"v_proj\" names model.layers.0.self_attn.v_proj, a "
          "linear layer quantized to NF4");
  refused({"layers"}, "names model.layers, which holds other modules");
  refused({"lm_heads"}, "modules_to_save entry \"lm_heads\" matches no module of the model");
  refused({"embed_tokens"}, "the embeddings of a model with tie_word_embeddings",
          "llama_tied_llama3");
  refused({"lm_head"}, "its embeddings are tied", "llama_tied_llama3");

  // PEFT's rule is a plain suffix: "norm" names every norm.
  llm::QLoRAOptions o = options({"q_proj"});
  o.lora.modules_to_save = {"norm", "embed_tokens", "lm_head"};
  const llm::QLoRAReport r = llm::apply_qlora(*model, o);
  CHECK(r.saved_modules == std::vector<std::string>{"model.layers.0.input_layernorm",
                                                    "model.layers.0.post_attention_layernorm",
                                                    "model.layers.1.input_layernorm",
                                                    "model.layers.1.post_attention_layernorm",
                                                    "model.norm", "model.embed_tokens", "lm_head"});
  int64_t trainable = 0;
  for (auto& [name, p] : model->named_parameters())
    if (p.requires_grad()) trainable += p.numel();
  CHECK(trainable == r.trainable_parameters);
  CHECK(r.trainable_parameters == 2 * 4 * (32 + 32) + 5 * 32 + 2 * 64 * 32);
  CHECK(model->find("lm_head.weight").requires_grad());

  // Saved under the modules' own names, read back into a fresh model.
  perturb_adapters(*model);
  {
    NoGradGuard no_grad;
    Tensor head = model->find("lm_head.weight");
    copy_(head, head * 1.5);
  }
  TempDir tmp;
  const std::string dir = tmp.path().string() + "/adapters";
  llm::save_peft_adapters(*model, o.lora, o.quantization, dir);
  const io::SafetensorsFile saved = io::load_safetensors(dir + "/adapter_model.safetensors");
  std::vector<std::string> names;
  for (const auto& [name, t] : saved.tensors) names.push_back(name);
  CHECK(std::count(names.begin(), names.end(), "base_model.model.lm_head.weight") == 1);
  CHECK(std::count(names.begin(), names.end(), "base_model.model.model.embed_tokens.weight") == 1);
  CHECK(std::count(names.begin(), names.end(), "base_model.model.model.norm.weight") == 1);
  CHECK(names.size() == 4 + 7);
  NoGradGuard no_grad;
  const Tensor want = model->logits(kIds);
  auto again = llm::load_causal_lm(model_dir("llama_gqa"));
  llm::apply_peft_adapters(*again, dir, model_dir("llama_gqa"));
  CHECK(again->logits(kIds).to_vector<float>() == want.to_vector<float>());
  // A folder whose saved lm_head is missing: refused, naming it.
  io::TensorMap partial;
  for (const auto& [name, t] : saved.tensors)
    if (name != "base_model.model.lm_head.weight") partial.emplace_back(name, t);
  io::save_safetensors(dir + "/adapter_model.safetensors", partial, {{"format", "pt"}});
  auto third = llm::load_causal_lm(model_dir("llama_gqa"));
  CHECK_THROWS_WITH_AS(llm::apply_peft_adapters(*third, dir, ""),
                       doctest::Contains("missing base_model.model.lm_head.weight"),
                       std::runtime_error);
}

TEST_CASE("PEFT adapter folders: written, read back, and refused when they do not fit") {
  TempDir tmp;
  const std::string dir = tmp.path().string() + "/adapters";
  auto model = llm::load_causal_lm(model_dir("qwen2_bias"));
  llm::QLoRAOptions o = options({"q_proj", "v_proj"}, 2);
  o.lora.use_rslora = true;
  o.lora.base_model_name_or_path = "qwen2_bias";
  llm::apply_qlora(*model, o);
  perturb_adapters(*model);
  llm::save_peft_adapters(*model, o.lora, o.quantization, dir);

  std::ifstream in(dir + "/adapter_config.json");
  const nlohmann::json config = nlohmann::json::parse(in);
  CHECK(config["peft_type"] == "LORA");
  CHECK(config["task_type"] == "CAUSAL_LM");
  CHECK(config["r"] == 2);
  CHECK(config["use_rslora"] == true);
  CHECK(config["target_modules"] == nlohmann::json({"q_proj", "v_proj"}));
  const io::SafetensorsFile saved = io::load_safetensors(dir + "/adapter_model.safetensors");
  CHECK(saved.tensors.size() == 8);
  CHECK(saved.tensors[0].first == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");

  NoGradGuard no_grad;
  const Tensor want = model->logits(kIds);
  auto again = llm::load_causal_lm(model_dir("qwen2_bias"));
  const llm::QLoRAReport r = llm::apply_peft_adapters(*again, dir, model_dir("qwen2_bias"));
  CHECK(r.layers.size() == 14);
  CHECK(again->logits(kIds).to_vector<float>() == want.to_vector<float>());

  // Another base, by name.
  auto other = llm::load_causal_lm(model_dir("llama_gqa"));
  CHECK_THROWS_WITH_AS(llm::apply_peft_adapters(*other, dir, model_dir("llama_gqa")),
                       doctest::Contains("made for base \"qwen2_bias\""), std::runtime_error);
  // Tensors that do not fit the config (another r): every one listed.
  nlohmann::json bad = config;
  bad["r"] = 3;
  std::ofstream(dir + "/adapter_config.json") << bad.dump();
  auto fourth = llm::load_causal_lm(model_dir("qwen2_bias"));
  CHECK_THROWS_WITH_AS(
      llm::apply_peft_adapters(*fourth, dir, ""),
      doctest::Contains("adapter_model.safetensors: "
                        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight is "
                        "[2, 32]: it has rank 2, the config gives the layer r 3"),
      std::runtime_error);
  // A damaged config: one line naming the file and the field.
  bad = config;
  bad["lora_bias"] = "yes";
  std::ofstream(dir + "/adapter_config.json") << bad.dump();
  auto third = llm::load_causal_lm(model_dir("qwen2_bias"));
  CHECK_THROWS_WITH_AS(llm::apply_peft_adapters(*third, dir, ""),
                       doctest::Contains("adapter_config.json: lora_bias must be true or false"),
                       std::runtime_error);
  // Options claimed over adapters trained without them: their tensors are
  // missing, found before the model is converted (it can take the next).
  for (const char* option : {"lora_bias", "use_dora"}) {
    CAPTURE(option);
    bad = config;
    bad[option] = true;
    std::ofstream(dir + "/adapter_config.json") << bad.dump();
    CHECK_THROWS_WITH_AS(
        llm::apply_peft_adapters(*third, dir, ""),
        doctest::Contains(
            (std::string("missing base_model.model.model.layers.0.self_attn.q_proj.") +
             (option == std::string("lora_bias") ? "lora_B.bias" : "lora_magnitude_vector"))
                .c_str()),
        std::runtime_error);
    CHECK(llm::lora_layers(*third).empty());
    CHECK(llm::nf4_layers(*third).empty());
  }
  std::ofstream(dir + "/adapter_config.json") << config.dump();
  llm::apply_peft_adapters(*third, dir, "");
  CHECK(third->logits(kIds).to_vector<float>() == want.to_vector<float>());
  bad = config;
  bad["target_modules"] = "(?P<name>.*proj)";  // Python's, not ECMAScript's
  std::ofstream(dir + "/adapter_config.json") << bad.dump();
  CHECK_THROWS_WITH_AS(
      llm::read_adapter_folder_config(dir),
      doctest::Contains("adapter_config.json: target_modules: \"(?P<name>.*proj)\" "
                        "is not a regular expression quanta reads"),
      std::runtime_error);
  CHECK_THROWS_WITH_AS(llm::read_adapter_folder_config(tmp.path().string() + "/none"),
                       doctest::Contains("not an adapter folder"), std::runtime_error);
}

TEST_CASE("merge_qlora: the merged float model computes what the adapted one does") {
  for (const bool dora : {false, true}) {
    CAPTURE(dora);
    TempDir tmp;
    auto model = llm::load_causal_lm(model_dir("llama_gqa"));
    llm::QLoRAOptions o = options({"all-linear"});
    o.lora.use_dora = dora;
    llm::apply_qlora(*model, o);
    perturb_adapters(*model);
    NoGradGuard no_grad;
    const Tensor adapted = model->logits(kIds);
    llm::merge_qlora(*model);
    CHECK(llm::lora_layers(*model).empty());
    CHECK(max_rel_diff(model->logits(kIds), adapted) < 1e-5);
    llm::save_causal_lm(*model, tmp.path().string() + "/merged");
    auto reloaded = llm::load_causal_lm(tmp.path().string() + "/merged");
    CHECK(reloaded->logits(kIds).to_vector<float>() == model->logits(kIds).to_vector<float>());
  }
}

TEST_CASE("apply_qlora: PEFT's bias and lora_bias train the chosen biases, saved and merged") {
  // qwen2_bias: q, k and v have biases; adapters on q_proj and o_proj.
  const auto trained_names = [](llm::TrainedBiases bias, bool lora_bias) {
    auto model = llm::load_causal_lm(model_dir("qwen2_bias"));
    llm::QLoRAOptions o = options({"q_proj", "o_proj"});
    o.lora.bias = bias;
    o.lora.lora_bias = lora_bias;
    std::vector<std::string> planned;
    for (const auto& [name, shape] : llm::planned_trained_tensors(*model, o))
      planned.push_back("base_model.model." + name);
    llm::apply_qlora(*model, o);
    std::vector<std::string> names;
    int64_t trainable = 0;
    for (const auto& [name, t] : llm::peft_trained_parameters(*model, o.lora)) {
      CHECK(t.requires_grad());
      names.push_back(name);
    }
    for (const Tensor& p : model->parameters()) trainable += p.requires_grad();
    CHECK(trainable == int64_t(names.size()));
    CHECK(planned == names);  // the plan names what the conversion makes
    return names;
  };
  const std::string l0 = "base_model.model.model.layers.0.self_attn.";
  const auto none = trained_names(llm::TrainedBiases::none, false);
  CHECK(none.size() == 8);
  const auto all = trained_names(llm::TrainedBiases::all, false);
  REQUIRE(all.size() == 14);  // and q's, k's, v's biases in both layers
  CHECK(std::count(all.begin(), all.end(), l0 + "q_proj.base_layer.bias") == 1);
  CHECK(std::count(all.begin(), all.end(), l0 + "k_proj.bias") == 1);
  CHECK(std::count(all.begin(), all.end(), l0 + "v_proj.bias") == 1);
  const auto lora_only = trained_names(llm::TrainedBiases::lora_only, true);
  REQUIRE(lora_only.size() == 8 + 4 + 2);  // B's biases, and q's own
  CHECK(std::count(lora_only.begin(), lora_only.end(), l0 + "q_proj.base_layer.bias") == 1);
  CHECK(std::count(lora_only.begin(), lora_only.end(), l0 + "o_proj.lora_B.bias") == 1);
  CHECK(std::count(lora_only.begin(), lora_only.end(), l0 + "k_proj.bias") == 0);

  // A setting that trains nothing is refused, the model unchanged.
  for (const auto bias : {llm::TrainedBiases::all, llm::TrainedBiases::lora_only}) {
    auto llama = llm::load_causal_lm(model_dir("llama_gqa"));
    llm::QLoRAOptions o = options({"q_proj"});
    o.lora.bias = bias;
    CHECK_THROWS_WITH_AS(llm::apply_qlora(*llama, o),
                         doctest::Contains((std::string("bias \"") +
                                            llm::trained_biases_name(bias) + "\" trains nothing")
                                               .c_str()),
                         std::invalid_argument);
    CHECK(llm::nf4_layers(*llama).empty());
  }
  auto qwen = llm::load_causal_lm(model_dir("qwen2_bias"));
  llm::QLoRAOptions only_o = options({"o_proj"});
  only_o.lora.bias = llm::TrainedBiases::lora_only;
  CHECK_THROWS_WITH_AS(llm::apply_qlora(*qwen, only_o),
                       doctest::Contains("no adapted layer has a bias"), std::invalid_argument);
  llm::QLoRAOptions with_dora = options({"q_proj"});
  with_dora.lora.lora_bias = true;
  with_dora.lora.use_dora = true;
  CHECK_THROWS_WITH_AS(llm::apply_qlora(*qwen, with_dora),
                       doctest::Contains("lora_bias is not available with use_dora"),
                       std::invalid_argument);

  // Trained biases and B's biases: saved, read back, merged.
  for (const bool on_o_proj : {false, true}) {
    CAPTURE(on_o_proj);
    TempDir tmp;
    const std::string dir = tmp.path().string() + "/adapters";
    auto model = llm::load_causal_lm(model_dir("qwen2_bias"));
    llm::QLoRAOptions o = options(on_o_proj ? std::vector<std::string>{"q_proj", "o_proj"}
                                            : std::vector<std::string>{"q_proj", "k_proj"});
    o.lora.bias = llm::TrainedBiases::all;
    o.lora.lora_bias = true;
    llm::apply_qlora(*model, o);
    perturb_adapters(*model);
    {
      NoGradGuard no_grad;
      Generator gen(5);
      for (const auto& [name, b] : llm::trained_biases(*model, o.lora.bias))
        copy_(b, b + randn(b.shape(), gen) * 0.05);
    }
    llm::save_peft_adapters(*model, o.lora, o.quantization, dir);
    NoGradGuard no_grad;
    const Tensor adapted = model->logits(kIds);
    auto again = llm::load_causal_lm(model_dir("qwen2_bias"));
    llm::apply_peft_adapters(*again, dir, "");
    CHECK(again->logits(kIds).to_vector<float>() == adapted.to_vector<float>());
    if (on_o_proj) {
      // o_proj has no bias to take B's: merging is refused before anything changes.
      CHECK_THROWS_WITH_AS(llm::merge_qlora(*model),
                           doctest::Contains("model.layers.0.self_attn.o_proj has lora_bias but "
                                             "no bias of its own"),
                           std::invalid_argument);
      CHECK(llm::lora_layers(*model).size() == 4);
      continue;
    }
    llm::merge_qlora(*model);
    CHECK(max_rel_diff(model->logits(kIds), adapted) < 1e-5);
  }
}

TEST_CASE("apply_qlora: trainable_token_indices trains token rows, saved, read back and merged") {
  const auto with_tokens = [](std::vector<std::pair<std::string, std::vector<int64_t>>> tokens) {
    llm::QLoRAOptions o = options({"q_proj"});
    o.lora.trainable_token_indices = std::move(tokens);
    return o;
  };
  // The embeddings' rows and the untied output layer's.
  const llm::QLoRAOptions o = with_tokens({{"embed_tokens", {2, 25, 60}}, {"lm_head", {5, 9}}});
  auto model = llm::load_causal_lm(model_dir("llama_gqa"));
  NoGradGuard no_grad;
  const Tensor base = model->logits(kIds);
  std::vector<std::pair<std::string, Shape>> planned = llm::planned_trained_tensors(*model, o);
  llm::apply_qlora(*model, o);
  std::vector<std::pair<std::string, Shape>> made;
  for (const auto& [name, t] : llm::peft_trained_parameters(*model, o.lora)) {
    CHECK(t.requires_grad());
    made.emplace_back(name.substr(std::string("base_model.model.").size()), t.shape());
  }
  CHECK(planned == made);
  CHECK(made[made.size() - 2] ==
        std::pair<std::string, Shape>{"model.embed_tokens.token_adapter.trainable_tokens_delta",
                                      {3, 32}});
  CHECK(made.back() ==
        std::pair<std::string, Shape>{"lm_head.token_adapter.trainable_tokens_delta", {2, 32}});
  // The rows start as they were: the model is its base (lora_B is zero).
  const Tensor quantized = model->logits(kIds);
  perturb_adapters(*model);
  Generator gen(17);
  for (const auto& [name, tokens] : model->trainable_tokens())
    copy_(tokens->values(), tokens->values() + randn(tokens->values().shape(), gen) * 0.1);
  const Tensor adapted = model->logits(kIds);
  CHECK(max_rel_diff(adapted, quantized) > 1e-3);

  TempDir tmp;
  llm::save_peft_adapters(*model, o.lora, o.quantization, tmp.path().string() + "/adapters");
  const nlohmann::json config =
      nlohmann::json::parse(std::ifstream(tmp.path().string() + "/adapters/adapter_config.json"));
  CHECK(config["trainable_token_indices"] ==
        nlohmann::json{{"embed_tokens", {2, 25, 60}}, {"lm_head", {5, 9}}});
  auto again = llm::load_causal_lm(model_dir("llama_gqa"));
  llm::apply_peft_adapters(*again, tmp.path().string() + "/adapters", "");
  CHECK(again->logits(kIds).to_vector<float>() == adapted.to_vector<float>());
  // Written into the weights: the same logits, bit for bit, saved and loaded.
  again->merge_trainable_tokens();
  CHECK(again->trainable_tokens().empty());
  CHECK(again->logits(kIds).to_vector<float>() == adapted.to_vector<float>());
  llm::merge_qlora(*model);
  CHECK(max_rel_diff(model->logits(kIds), adapted) < 1e-5);
  llm::save_causal_lm(*model, tmp.path().string() + "/merged");
  auto reloaded = llm::load_causal_lm(tmp.path().string() + "/merged");
  CHECK(reloaded->logits(kIds).to_vector<float>() == model->logits(kIds).to_vector<float>());

  // A tied model: its output layer shares the embeddings' rows (and a
  // lm_head entry with the same indices, as PEFT takes it).
  auto tied = llm::load_causal_lm(model_dir("llama_tied_llama3"));
  llm::apply_qlora(*tied, with_tokens({{"", {2, 5}}}));
  REQUIRE(tied->trainable_tokens().size() == 1);
  CHECK(tied->lm_head_weight().to_vector<float>() ==
        tied->trainable_tokens()[0].second->apply(tied->lm_head_weight()).to_vector<float>());
  auto tied_both = llm::load_causal_lm(model_dir("llama_tied_llama3"));
  llm::apply_qlora(*tied_both, with_tokens({{"embed_tokens", {2, 5}}, {"lm_head", {2, 5}}}));
  CHECK(tied_both->trainable_tokens().size() == 1);

  // Refusals name the problem and change nothing.
  const std::vector<std::pair<llm::QLoRAOptions, std::string>> refused = {
      {with_tokens({{"", {2, 64}}}), "token 64 is outside the vocabulary of 64"},
      {with_tokens({{"norm", {2}}}), "trainable_token_indices names \"norm\", neither"},
      {with_tokens({{"embed_tokens", {2}}, {"model.embed_tokens", {3}}}),
       "names model.embed_tokens twice"},
  };
  for (const auto& [opts, says] : refused) {
    CAPTURE(says);
    auto m = llm::load_causal_lm(model_dir("llama_gqa"));
    CHECK_THROWS_WITH_AS(llm::apply_qlora(*m, opts), doctest::Contains(says.c_str()),
                         std::invalid_argument);
    CHECK(llm::nf4_layers(*m).empty());
  }
  llm::QLoRAOptions both = with_tokens({{"", {2}}});
  both.lora.modules_to_save = {"lm_head"};
  llm::QLoRAOptions saved_too = with_tokens({{"lm_head", {2}}});
  saved_too.lora.modules_to_save = {"lm_head"};
  auto m = llm::load_causal_lm(model_dir("llama_gqa"));
  CHECK_THROWS_WITH_AS(llm::apply_qlora(*m, saved_too),
                       doctest::Contains("trainable_token_indices and modules_to_save both name "
                                         "lm_head"),
                       std::invalid_argument);
  llm::apply_qlora(*m, both);  // rows of the embeddings, lm_head whole: allowed
  auto tied_head = llm::load_causal_lm(model_dir("llama_tied_llama3"));
  CHECK_THROWS_WITH_AS(llm::apply_qlora(*tied_head, with_tokens({{"lm_head", {3}}})),
                       doctest::Contains("lm_head of a model with tie_word_embeddings"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(llm::check_lora_settings(with_tokens({{"", {2, 2}}}).lora),
                       doctest::Contains("gives 2 twice"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(llm::check_lora_settings(with_tokens({{"", {2}}, {"lm_head", {3}}}).lora),
                       doctest::Contains("a list or an object, not both"), std::invalid_argument);
}

TEST_CASE("recompute_layers: the same loss, adapter gradients and dropout draws, on every device") {
  const std::vector<Device> devices = cpu_and_test_devices();  // sim, and cuda on a GPU
  for (const Device dev : devices)
    for (const bool dora : {false, true}) {
      INFO("device ", dev.str(), ", DoRA ", dora);
      const auto run = [&](bool recompute) {
        auto model = dropout_model(dev, recompute, dora);
        const Tensor ids = kIds.to(dev);
        const Tensor loss = llm::chunked_causal_lm_loss(
            model->hidden_states(ids), model->lm_head_weight(), ids, {.chunk_tokens = 4});
        loss.backward();
        std::vector<std::vector<float>> out{loss.to_vector<float>()};
        for (const Tensor& p : model->parameters())
          if (p.requires_grad()) {
            REQUIRE(p.grad().defined());
            out.push_back(p.grad().to_vector<float>());
          }
        // A second step draws on from where the first left the streams.
        for (Generator* g : model->random_streams()) out.push_back({float(g->state().offset.lo)});
        return out;
      };
      const auto plain = run(false), recomputed = run(true);
      REQUIRE(plain.size() == recomputed.size());
      CHECK(plain.size() > 20);
      CHECK(plain.back()[0] > 0);  // dropout drew
      for (size_t i = 0; i < plain.size(); ++i) {
        INFO("entry ", i);
        CHECK(plain[i] == recomputed[i]);
      }
    }
}

// A QLoRA step captured as a DeviceGraph (NF4 bases, adapters with dropout
// drawn from the layers' own streams, attention, the chunked loss; with and
// without recomputed layers; DoRA, its weight decoded and its norm taken
// inside the graph) and replayed on new tokens: the uncaptured steps'
// losses, the adapters after them and the streams' offsets, bit for bit.
TEST_CASE("a captured QLoRA step replays the uncaptured steps bit for bit") {
  for (const Device dev : test_devices()) {
    for (const auto& [recompute, dora] :
         {std::pair{false, false}, std::pair{true, false}, std::pair{false, true}}) {
      INFO("device ", dev.str(), ", recompute ", recompute, ", DoRA ", dora);
      const auto run = [&](bool captured) {
        auto model = dropout_model(dev, recompute, dora);
        std::vector<Tensor> adapters;
        for (const Tensor& p : model->parameters())
          if (p.requires_grad()) adapters.push_back(p);
        AdamW opt(adapters, AdamWOptions{.lr = 1e-2, .weight_decay = 0.0});
        Tensor ids = empty(kIds.shape(), {.dtype = DType::i64, .device = dev});
        Tensor loss;
        auto forward_backward = [&] {
          loss = llm::chunked_causal_lm_loss(model->hidden_states(ids), model->lm_head_weight(),
                                             ids, {.chunk_tokens = 4});
          loss.backward();
        };
        std::optional<DeviceGraph> graph;
        std::vector<std::vector<float>> out;
        for (int64_t s = 0; s < 4; ++s) {
          std::vector<int64_t> step_ids = kIds.to_vector<int64_t>();
          for (int64_t& v : step_ids) v = (v + 7 * s) % 50;  // each step its own tokens
          copy_(ids, from_vector<int64_t>(step_ids, kIds.shape()));
          if (!captured) {
            opt.zero_grad();
            forward_backward();
          } else {
            if (!graph) {
              opt.zero_grad();  // the captured backward assigns the gradients
              graph = DeviceGraph::capture(dev, forward_backward);
            }
            graph->replay();
          }
          opt.step();
          out.push_back(loss.to(Device::cpu()).to_vector<float>());
        }
        for (const Tensor& p : adapters) out.push_back(p.to(Device::cpu()).to_vector<float>());
        for (Generator* g : model->random_streams()) out.push_back({float(g->state().offset.lo)});
        if (captured) CHECK(graph->draws() > 0);
        return out;
      };
      const auto eager = run(false), replayed = run(true);
      REQUIRE(eager.size() == replayed.size());
      CHECK(eager[0] != eager[1]);  // the steps differ
      for (size_t i = 0; i < eager.size(); ++i) {
        INFO("entry ", i);
        CHECK(replayed[i] == eager[i]);
      }
    }
  }
}

TEST_CASE("init_lora_weights: PEFT's spellings, and the starts taken out of the base") {
  llm::LoraSettings l;
  llm::set_lora_init(l, "pissa_niter_4");
  CHECK(l.init_lora_weights == llm::LoraInit::pissa);
  CHECK(l.pissa_niter == 4);
  CHECK(llm::lora_init_text(l) == "pissa_niter_4");
  for (const std::string text :
       {"true", "gaussian", "false", "loftq", "pissa", "olora", "orthogonal", "eva", "corda"}) {
    llm::set_lora_init(l, text);
    CHECK(llm::lora_init_text(l) == text);
    CHECK(l.pissa_niter == -1);
  }
  CHECK(llm::takes_start_from_base(llm::LoraInit::pissa));
  CHECK(llm::takes_start_from_base(llm::LoraInit::olora));
  CHECK(llm::takes_start_from_base(llm::LoraInit::corda));
  CHECK_FALSE(llm::takes_start_from_base(llm::LoraInit::loftq));
  CHECK_THROWS_WITH_AS(llm::set_lora_init(l, "pissa_niter_"),
                       doctest::Contains("pissa_niter_ takes the number of power iterations"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(llm::set_lora_init(l, "kaiming"),
                       doctest::Contains("must be true, gaussian, false, loftq, pissa, "
                                         "pissa_niter_<N>, olora, orthogonal, eva or corda, got "
                                         "\"kaiming\""),
                       std::invalid_argument);
  // The settings PEFT's conversion writes, and back.
  llm::LoraSettings s;
  s.r = 4;
  s.lora_alpha = 6;
  s.rank_pattern = {{"q_proj", 2}};
  s.alpha_pattern = {{"v_proj", 3}};
  llm::set_lora_init(s, "olora");
  const llm::LoraSettings c = llm::converted_to_lora(s);
  CHECK(c.r == 8);
  CHECK(c.lora_alpha == 12);
  CHECK(c.rank_pattern[0].second == 4);
  CHECK(c.alpha_pattern[0].second == 6);
  CHECK(c.init_lora_weights == llm::LoraInit::kaiming_uniform);
  llm::BaseQuantization q;
  q.start_taken_out = "olora";
  q.start_lora_alpha = 6;
  const llm::LoraSettings back = llm::trained_from_start(c, q);
  CHECK(back.r == 4);
  CHECK(back.lora_alpha == 6);
  CHECK(back.rank_pattern[0].second == 2);
  CHECK(back.alpha_pattern[0].second == 3);
  CHECK(back.init_lora_weights == llm::LoraInit::olora);
  // rsLoRA keeps alpha / sqrt(r): alpha times sqrt(2) as r doubles.
  s.rank_pattern.clear();
  s.alpha_pattern.clear();
  s.use_rslora = true;
  CHECK(llm::converted_to_lora(s).lora_alpha == doctest::Approx(6 * std::sqrt(2.0)));
  // PEFT's conversion cannot express rsLoRA's patterns, nor does it.
  s.rank_pattern = {{"q_proj", 2}};
  CHECK_THROWS_WITH_AS(llm::check_lora_settings(s),
                       doctest::Contains("with use_rslora and rank_pattern or alpha_pattern"),
                       std::invalid_argument);
  llm::LoraSettings odd;
  odd.r = 3;
  llm::set_lora_init(odd, "orthogonal");
  CHECK_THROWS_WITH_AS(llm::check_lora_settings(odd),
                       doctest::Contains("orthogonal needs an even r, got 3"),
                       std::invalid_argument);
  odd.r = 4;
  odd.rank_pattern = {{"k_proj", 5}};
  CHECK_THROWS_WITH_AS(llm::check_lora_settings(odd),
                       doctest::Contains("rank_pattern \"k_proj\" gives 5"), std::invalid_argument);
  llm::LoraSettings stray;
  stray.pissa_niter = 2;
  CHECK_THROWS_WITH_AS(llm::check_lora_settings(stray),
                       doctest::Contains("pissa_niter 2 is given with init_lora_weights true"),
                       std::invalid_argument);
}

TEST_CASE("PEFT adapter folders from PiSSA and OLoRA: converted, recorded, read back exactly") {
  TempDir tmp;
  for (const std::string init : {"pissa", "pissa_niter_3", "olora"}) {
    INFO(init);
    const std::string dir = tmp.path().string() + "/" + init;
    auto model = llm::load_causal_lm(model_dir("qwen2_bias"));
    llm::QLoRAOptions o = options({"q_proj", "v_proj", "down_proj"}, 2);
    o.lora.rank_pattern = {{"down_proj", 4}};
    o.lora.alpha_pattern = {{"v_proj", 3}};
    o.lora.bias = llm::TrainedBiases::lora_only;
    llm::set_lora_init(o.lora, init);
    llm::apply_qlora(*model, o);
    perturb_adapters(*model);
    llm::save_peft_adapters(*model, o.lora, o.quantization, dir);
    std::ifstream in(dir + "/adapter_config.json");
    const nlohmann::json config = nlohmann::json::parse(in);
    CHECK(config["r"] == 4);
    CHECK(config["lora_alpha"] == 16.0);
    CHECK(config["rank_pattern"]["down_proj"] == 8);
    CHECK(config["alpha_pattern"]["v_proj"] == 6.0);
    CHECK(config["init_lora_weights"] == true);
    CHECK(config["quanta_base_quantization"]["start_taken_out"]["init_lora_weights"] == init);
    const io::SafetensorsFile saved = io::load_safetensors(dir + "/adapter_model.safetensors");
    for (const auto& [name, t] : saved.tensors) {
      INFO(name);
      if (name.ends_with("down_proj.lora_A.weight")) CHECK(t.shape()[0] == 8);
      if (name.ends_with("q_proj.lora_B.weight")) CHECK(t.shape()[1] == 4);
      if (name.ends_with(".base_layer.bias")) CHECK(t.dim() == 1);  // biases as they train
    }
    NoGradGuard no_grad;
    const Tensor want = model->logits(kIds);
    auto again = llm::load_causal_lm(model_dir("qwen2_bias"));
    llm::apply_peft_adapters(*again, dir, model_dir("qwen2_bias"));
    CHECK(again->logits(kIds).to_vector<float>() == want.to_vector<float>());
    const llm::AdapterFolderConfig read = llm::read_adapter_folder_config(dir);
    CHECK(read.lora.r == 2);
    CHECK(read.lora.lora_alpha == 8);
    CHECK(llm::lora_init_text(read.lora) == init);
    // A record that does not hold together: one line naming the file.
    nlohmann::json bad = config;
    bad["quanta_base_quantization"]["start_taken_out"]["init_lora_weights"] = "loftq";
    std::ofstream(dir + "/adapter_config.json") << bad.dump();
    CHECK_THROWS_WITH_AS(llm::read_adapter_folder_config(dir),
                         doctest::Contains("start_taken_out.init_lora_weights must be pissa, "
                                           "pissa_niter_<N>, olora or corda, got \"loftq\""),
                         std::runtime_error);
    bad = config;
    bad["r"] = 5;
    std::ofstream(dir + "/adapter_config.json") << bad.dump();
    CHECK_THROWS_WITH_AS(llm::read_adapter_folder_config(dir),
                         doctest::Contains("adapter_config.json: r 5 is odd"), std::runtime_error);
  }
  // A folder PEFT saved from PiSSA without converting it names the start:
  // PEFT's loader takes it out of the float base again, and so does quanta.
  const std::string dir = tmp.path().string() + "/converted";
  auto model = llm::load_causal_lm(model_dir("qwen2_bias"));
  llm::QLoRAOptions o = options({"q_proj", "v_proj"}, 2);
  llm::set_lora_init(o.lora, "pissa");
  llm::apply_qlora(*model, o);
  perturb_adapters(*model);
  llm::save_peft_adapters(*model, o.lora, o.quantization, dir);
  std::ifstream in(dir + "/adapter_config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  config["r"] = 2;
  config["lora_alpha"] = 8;
  config["init_lora_weights"] = "pissa";
  config["quanta_base_quantization"].erase("start_taken_out");
  const std::string unconverted = tmp.path().string() + "/unconverted";
  fs::create_directories(unconverted);
  std::ofstream(unconverted + "/adapter_config.json") << config.dump(2);
  io::TensorMap trained;
  for (auto& [name, t] : io::load_safetensors(dir + "/adapter_model.safetensors").tensors)
    trained.emplace_back(name,
                         narrow(t, name.ends_with("lora_A.weight") ? 0 : 1, 0, 2).contiguous());
  io::save_safetensors(unconverted + "/adapter_model.safetensors", trained);
  NoGradGuard no_grad;
  auto again = llm::load_causal_lm(model_dir("qwen2_bias"));
  llm::apply_peft_adapters(*again, unconverted, "");
  CHECK(again->logits(kIds).to_vector<float>() == model->logits(kIds).to_vector<float>());
}
