// save_merged_causal_lm: a fine-tuned model merged and written a layer at a
// time. Checked here: its folder is merge_qlora's then save_causal_lm's,
// byte for byte, for adapters on every layer or some (the rest dequantized),
// DoRA, trained biases and lora_bias, trainable tokens, bf16 and tied models
// and an image-text model's vision tower; the model it was given keeps its
// adapters; a device (sim counts its bytes; CUDA's allocator where a GPU is
// visible) holds the converted model and a float layer or two, never the
// merged model; a refused merge writes nothing.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/linalg.h"
#include "engine/ops/reduce.h"
#include "llm/model/model_folder.h"
#include "llm/model/weight_names.h"
#include "llm/qlora/qlora_model.h"
#include "support/device_memory.h"
#include "support/gpu.h"
#include "support/random_llama_folder.h"
#include "support/relative_error.h"
#include "support/temp_dir.h"
#include "support/test_data.h"

using namespace quanta;
using namespace quanta::testing;

namespace {

std::string model_dir(const std::string& name) {
  return quanta::testing::test_data("llm/models/" + name);
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

llm::QLoRAOptions options(std::vector<std::string> targets) {
  llm::QLoRAOptions o;
  o.lora.r = 4;
  o.lora.lora_alpha = 8;
  o.lora.target_modules = std::move(targets);
  o.quantization.compute_dtype = DType::f32;
  o.seed = 3;
  return o;
}

// Moves every trained tensor off its start, so that merging changes weights.
void perturb(llm::CausalLM& model) {
  NoGradGuard no_grad;
  Generator gen(11);
  for (auto& [name, p] : model.named_parameters())
    if (p.requires_grad()) copy_(p, p + randn(p.shape(), gen).to(p.dtype()).to(p.device()) * 0.05);
}

// The folder `dir`'s model converted with `o` on `dev`, trained tensors
// perturbed.
std::shared_ptr<llm::CausalLM> converted(const std::string& dir, const llm::QLoRAOptions& o,
                                         Device dev = Device::cpu()) {
  auto model = llm::load_causal_lm(dir, dev, {.defer_layer_weights = true});
  llm::apply_qlora(*model, o);
  perturb(*model);
  return model;
}

}  // namespace

TEST_CASE("save_merged_causal_lm writes merge_qlora's folder byte for byte, a layer at a time") {
  struct Case {
    const char* model;
    llm::QLoRAOptions options;
  };
  std::vector<Case> cases;
  cases.push_back({"llama_gqa", options({"all-linear"})});
  cases.push_back({"llama_gqa", options({"q_proj", "down_proj"})});  // the rest dequantized
  cases.push_back({"llama_gqa", options({"all-linear"})});
  cases.back().options.lora.use_dora = true;
  cases.push_back({"qwen2_bias", options({"q_proj", "k_proj", "v_proj"})});
  cases.back().options.lora.bias = llm::TrainedBiases::all;
  cases.back().options.lora.lora_bias = true;
  cases.push_back({"llama_gqa", options({"q_proj"})});
  cases.back().options.lora.trainable_token_indices = {{"embed_tokens", {2, 25}}, {"lm_head", {5}}};
  cases.push_back({"llama_bf16", options({"all-linear"})});
  cases.push_back({"llama_tied_llama3", options({"all-linear"})});
  cases.push_back({"phi3_fused", options({"all-linear"})});
  cases.push_back({"gemma3_image_text", options({"all-linear"})});
  for (const Device dev : cpu_and_test_devices())
    for (std::size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      INFO(dev.str(), " case ", i, " ", c.model);
      TempDir tmp;
      const std::string streamed = tmp.file("streamed"), whole = tmp.file("whole");
      const StateDict beside = llm::read_non_decoder_weights(
          llm::load_causal_lm(model_dir(c.model), Device::cpu(), {.defer_layer_weights = true})
              ->config(),
          model_dir(c.model));
      auto model = converted(model_dir(c.model), c.options, dev);
      const size_t adapters = llm::lora_layers(*model).size();
      std::vector<float> adapted;
      {
        NoGradGuard no_grad;
        adapted = model->logits(from_vector<int64_t>({1, 5, 9, 2}, {1, 4}).to(dev))
                      .to(DType::f32)
                      .to_vector<float>();
      }
      llm::save_merged_causal_lm(*model, streamed, beside);
      // The model is still the fine-tuned one: its adapters stay.
      CHECK(llm::lora_layers(*model).size() == adapters);
      llm::merge_qlora(*model);
      llm::save_causal_lm(*model, whole, beside);
      CHECK(file_bytes(streamed + "/config.json") == file_bytes(whole + "/config.json"));
      const std::string bytes = file_bytes(streamed + "/model.safetensors");
      CHECK(bytes.size() > 1000);
      CHECK(bytes == file_bytes(whole + "/model.safetensors"));
      // And it loads as the merged model, computing what the adapted one did.
      auto merged = llm::load_causal_lm(streamed);
      NoGradGuard no_grad;
      const std::vector<float> logits = merged->logits(from_vector<int64_t>({1, 5, 9, 2}, {1, 4}))
                                            .to(DType::f32)
                                            .to_vector<float>();
      REQUIRE(logits.size() == adapted.size());
      double worst = 0, scale = 0;
      for (std::size_t j = 0; j < logits.size(); ++j) {
        worst = std::max(worst, double(std::abs(logits[j] - adapted[j])));
        scale = std::max(scale, double(std::abs(adapted[j])));
      }
      CHECK(worst <= scale * (c.options.lora.use_dora || dev.is_cuda() ? 1e-4 : 1e-5) +
                         (std::string(c.model) == "llama_bf16" ? scale * 2e-2 : 0));
    }
}

TEST_CASE("save_merged_causal_lm in shards: merge_qlora's shards and index, in the model's order") {
  for (const std::string name : {"llama_gqa", "qwen2_bias", "gemma3_image_text"}) {
    INFO(name);
    TempDir tmp;
    const StateDict beside = llm::read_non_decoder_weights(
        llm::load_causal_lm(model_dir(name), Device::cpu(), {.defer_layer_weights = true})
            ->config(),
        model_dir(name));
    auto model = converted(model_dir(name), options({"q_proj", "down_proj"}));
    const llm::SaveOptions shards{.max_shard_bytes = 12000};
    llm::save_merged_causal_lm(*model, tmp.file("streamed"), beside, shards);
    llm::merge_qlora(*model);
    llm::save_causal_lm(*model, tmp.file("whole"), beside, shards);
    std::vector<std::string> files;
    for (const auto& e : std::filesystem::directory_iterator(tmp.file("whole")))
      files.push_back(e.path().filename().string());
    CHECK(files.size() > 4);
    for (const std::string& f : files) {
      CAPTURE(f);
      CHECK(file_bytes(tmp.file("streamed/" + f)) == file_bytes(tmp.file("whole/" + f)));
    }
    CHECK(std::distance(std::filesystem::directory_iterator(tmp.file("streamed")),
                        std::filesystem::directory_iterator()) == std::ptrdiff_t(files.size()));
  }
}

TEST_CASE(
    "save_merged_causal_lm: the device holds the converted model and a layer, not the merge") {
  // Layers of 64 and 128 KiB: in the fixtures' 8 KiB layers, CUDA's size
  // classes and a product's small tensors hide the difference.
  TempDir folder;
  const std::string dir = folder.file("llama");
  write_random_llama(dir, RandomLlama{}, 4);
  for (const Device dev : test_devices()) {
    INFO(dev.str());
    const DeviceMemory memory(dev);
    TempDir tmp;
    auto model = converted(dir, options({"all-linear"}), dev);
    synchronize(dev);
    memory.reset_peak();
    const int64_t before = memory.held();
    llm::save_merged_causal_lm(*model, tmp.file("streamed"));
    synchronize(dev);
    const int64_t streamed_peak = memory.peak() - before;
    CHECK(memory.held() == before);  // nothing of the merge stays on the device

    // The largest float layer, and the model merged whole.
    int64_t largest = 0, merged_model = 0;
    for (const auto& [name, t] : llm::load_causal_lm(tmp.file("streamed"))->state_dict()) {
      merged_model += t.nbytes();
      if (t.dim() == 2 && name.find("embed") == std::string::npos)
        largest = std::max<int64_t>(largest, t.nbytes());
    }
    MESSAGE(dev.str(), ": streamed merge peaked ", streamed_peak, " bytes above the model; ",
            "largest layer ", largest, ", merged model ", merged_model);
    // merged_weight holds the dequantized weight and the adapters' product,
    // summed in place: two layers, never the merged model (plus a scalar or
    // two, and on CUDA what its size classes round up).
    CHECK(streamed_peak <= 2 * largest + (dev.is_sim() ? 1024 : 64 * 1024));
    CHECK(3 * largest < merged_model);
    // Merging in place holds far more, and ends holding the merged model.
    memory.reset_peak();
    llm::merge_qlora(*model);
    synchronize(dev);
    const int64_t in_place_peak = memory.peak() - before;
    MESSAGE(dev.str(), ": merging in place peaked ", in_place_peak, " bytes above the model");
    CHECK(2 * streamed_peak < in_place_peak);
    int64_t merged_held = 0;
    for (const auto& [name, t] : model->state_dict()) merged_held += memory.counted(t.nbytes());
    CHECK(merged_held >= merged_model);
    CHECK(memory.held() >= merged_held);
  }
}

TEST_CASE("save_merged_causal_lm over the float weights: PEFT's merge over the float model") {
  const std::string dir = model_dir("llama_gqa");
  const auto float_weight = llm::decoder_weight_reader(dir);
  for (const bool dora : {false, true}) {
    INFO("dora ", dora);
    llm::QLoRAOptions o = options({"q_proj", "down_proj"});  // r 4, alpha 8: s = 2
    o.lora.use_dora = dora;
    auto model = converted(dir, o);
    TempDir tmp;
    llm::save_merged_causal_lm(*model, tmp.file("float"), {}, {}, float_weight);
    std::map<std::string, Tensor> merged;
    for (const auto& [name, t] : llm::read_model_weights(tmp.file("float"))) merged[name] = t;
    std::set<std::string> adapted;
    NoGradGuard no_grad;
    for (const auto& [name, layer] : llm::lora_layers(*model)) {
      CAPTURE(name);
      adapted.insert(name + ".weight");
      const Tensor w = float_weight(name + ".weight");
      Tensor want = w + matmul(layer->lora_B(), layer->lora_A()) * 2.0;
      if (dora)
        want = want * (layer->magnitude().reshape({-1, 1}) /
                       sqrt(sum(square(want), {1}, /*keepdim=*/true)));
      CHECK(max_abs(merged.at(name + ".weight") - want) <= 1e-6 * max_abs(want));
    }
    CHECK(adapted.size() == 4);
    // Every other linear weight of the layers is the float one, bit for bit.
    int64_t kept = 0;
    for (const auto& [name, t] : merged)
      if (name.find(".layers.") != std::string::npos && t.dim() == 2 && !adapted.count(name)) {
        CAPTURE(name);
        CHECK(t.to_vector<float>() == float_weight(name).to_vector<float>());
        ++kept;
      }
    CHECK(kept == 10);
  }
  CHECK_THROWS_WITH_AS(float_weight("model.layers.9.mlp.up_proj.weight"),
                       doctest::Contains("holds no weight model.layers.9.mlp.up_proj.weight"),
                       std::invalid_argument);
}

TEST_CASE("save_merged_causal_lm refuses what merge_qlora refuses, and writes nothing") {
  llm::QLoRAOptions o = options({"o_proj"});
  o.lora.lora_bias = true;  // qwen2's o_proj has no bias to take B's
  auto model = converted(model_dir("qwen2_bias"), o);
  TempDir tmp;
  CHECK_THROWS_WITH_AS(llm::save_merged_causal_lm(*model, tmp.file("merged")),
                       doctest::Contains("o_proj has lora_bias but no bias of its own"),
                       std::invalid_argument);
  CHECK_FALSE(std::filesystem::exists(tmp.file("merged")));
  CHECK(llm::lora_layers(*model).size() == 2);
}
