// CorDA's start (llm/qlora/corda_init.h) beyond the PEFT parity cases
// (test_qlora_parity.cpp): layers reading one input share one covariance,
// which is what each would have summed; the settings in adapter_config.json;
// the refusals, which leave every layer in place; a folder PEFT saved
// unconverted from CorDA's start, which no loader can read without its data;
// and the covariance file that spares a second run the samples.
#include <doctest/doctest.h>

#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "engine/factory.h"
#include "engine/io/safetensors.h"
#include "llm/data/lm_examples.h"
#include "llm/model/model_folder.h"
#include "llm/qlora/bnb_folder.h"
#include "llm/qlora/corda_init.h"
#include "llm/qlora/lora_config.h"
#include "llm/qlora/qlora_model.h"
#include "quanta.h"
#include "random_windows.h"
#include "support/relative_error.h"
#include "support/temp_dir.h"
#include "support/test_data.h"

using namespace quanta;
using namespace quanta::testing;

namespace {

std::string llm_dir(const std::string& name) { return quanta::testing::test_data("llm/" + name); }

llm::QLoRAOptions corda_options() {
  llm::QLoRAOptions o;
  o.lora.r = 4;
  o.lora.lora_alpha = 8;
  llm::set_lora_init(o.lora, "corda");
  o.quantization.compute_dtype = DType::f32;
  return o;
}

const std::vector<std::string> kLayer0 = {
    "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
    "model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.o_proj",
    "model.layers.0.mlp.gate_proj",    "model.layers.0.mlp.up_proj",
    "model.layers.0.mlp.down_proj"};

}  // namespace

TEST_CASE("CorDA: layers reading one input share its covariance, the sum each would make") {
  const llm::LmExamples examples = random_windows(6, 16, 1);
  auto model = llm::load_causal_lm(llm_dir("models/llama_gqa"));
  const std::vector<Tensor> all =
      llm::corda_covariances(*model, kLayer0, llm::corda_samples_in_order(examples, 0));
  REQUIRE(all.size() == 7);
  // k and v read q's input, up reads gate's: one tensor each.
  CHECK(all[1].storage() == all[0].storage());
  CHECK(all[2].storage() == all[0].storage());
  CHECK(all[5].storage() == all[4].storage());
  CHECK(all[3].storage() != all[0].storage());
  CHECK(all[6].storage() != all[4].storage());
  // Alone, each layer sums the same covariance.
  for (const std::size_t i : {1, 2, 5}) {
    const std::vector<Tensor> alone =
        llm::corda_covariances(*model, {kLayer0[i]}, llm::corda_samples_in_order(examples, 0));
    CHECK(max_abs(alone[0] - all[i]) == 0);
  }
  // Symmetric with a positive diagonal; fewer samples, another covariance.
  CHECK(max_abs(all[6] - transpose(all[6], 0, 1)) < 1e-6);
  CHECK(min(sum(all[6] * eye(48), {0})).item() > 0);
  const std::vector<Tensor> two =
      llm::corda_covariances(*model, {kLayer0[6]}, llm::corda_samples_in_order(examples, 2));
  CHECK(max_abs(two[0] - all[6]) > 1e-4);
  // Nothing of the model changed.
  CHECK(llm::nf4_layers(*model).empty());
}

TEST_CASE("CorDA's settings in adapter_config.json, and apply_qlora without covariances") {
  llm::LoraSettings l;
  llm::set_lora_init(l, "corda");
  l.corda_config.method = quant::CordaMethod::kpm;
  CHECK(llm::lora_init_text(l) == "corda");
  CHECK(llm::takes_start_from_base(l.init_lora_weights));
  const nlohmann::json j =
      nlohmann::json::parse(llm::adapter_config_json(l, llm::BaseQuantization{}).dump());
  CHECK(j["init_lora_weights"] == "corda");
  CHECK(j["corda_config"]["corda_method"] == "kpm");
  CHECK(j["corda_config"]["covariance_file"].is_null());
  // Saved folders hold CorDA's adapters converted to LoRA; adapters PEFT
  // saved unconverted fit a base only their data can rebuild.
  CHECK_THROWS_WITH_AS(
      llm::read_adapter_config(llm::adapter_config_json(l, llm::BaseQuantization{}), "corda/"),
      doctest::Contains("needs the input covariances of the samples it was computed from"),
      std::runtime_error);
  auto model = llm::load_causal_lm(llm_dir("models/llama_gqa"));
  llm::QLoRAOptions o = corda_options();
  CHECK_THROWS_WITH_AS(llm::apply_qlora(*model, o),
                       doctest::Contains("none is given for layer model.layers.0.self_attn.q_proj "
                                         "(apply_qlora_corda collects them"),
                       std::invalid_argument);
  CHECK(llm::nf4_layers(*model).empty());
}

TEST_CASE("CorDA's refusals name the problem and leave every layer in place") {
  const llm::LmExamples examples = random_windows(6, 16, 2);
  auto model = llm::load_causal_lm(llm_dir("models/llama_gqa"));
  const auto untouched = [&] {
    CHECK(llm::nf4_layers(*model).empty());
    CHECK(llm::lora_layers(*model).empty());
    std::size_t linear = 0;
    for (auto& [name, m] : model->named_modules()) linear += m->type_name() == "Linear";
    CHECK(linear == 15);  // no tap left behind: 14 and lm_head
  };
  llm::QLoRAOptions o = corda_options();
  o.lora.init_lora_weights = llm::LoraInit::pissa;
  CHECK_THROWS_WITH_AS(llm::apply_qlora_corda(*model, o, llm::corda_samples_in_order(examples, 0)),
                       doctest::Contains("init_lora_weights is pissa, not corda"),
                       std::invalid_argument);
  o = corda_options();
  CHECK_THROWS_WITH_AS(llm::apply_qlora_corda(*model, o, llm::CordaData{}),
                       doctest::Contains("at least one sample"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(llm::corda_samples_in_order(examples, -1),
                       doctest::Contains("count must be >= 0"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(llm::corda_covariances(*model, {"model.layers.0.mlp"},
                                              llm::corda_samples_in_order(examples, 0)),
                       doctest::Contains("model.layers.0.mlp is not a linear layer"),
                       std::invalid_argument);
  untouched();
  // An embedding row of NaN: the first layer's covariance, after the first
  // sample that reads it, named.
  for (auto& [name, p] : model->named_parameters())
    if (NoGradGuard no_grad; name == "model.embed_tokens.weight")
      copy_(narrow(p, 0, 0, 64), full({64, p.size(1)}, std::numeric_limits<double>::quiet_NaN()));
  CHECK_THROWS_WITH_AS(
      llm::corda_covariances(*model, kLayer0, llm::corda_samples_in_order(examples, 0)),
      doctest::Contains("layer model.layers.0.self_attn.q_proj's input covariance is not "
                        "finite after sample 0"),
      std::invalid_argument);
  untouched();
  // Over a 4-bit folder: no float weights, refused before the data is read.
  auto four_bit = llm::load_base_model(llm_dir("qlora/transformers_4bit/llama_gqa"));
  llm::CordaData counting = llm::corda_samples_in_order(examples, 0);
  int64_t read = 0;
  counting.on_sample = [&](int64_t, int64_t) { ++read; };
  CHECK_THROWS_WITH_AS(llm::apply_qlora_corda(*four_bit, o, counting),
                       doctest::Contains("was loaded in 4 bits (a 4-bit folder)"),
                       std::invalid_argument);
  CHECK(read == 0);
  CHECK(llm::lora_layers(*four_bit).empty());
}

TEST_CASE("CorDA's covariance file: written once, read back shared, the same start") {
  TempDir dir("corda_file");
  const std::string path = dir.file("covariances.safetensors");
  const llm::LmExamples examples = random_windows(6, 16, 3);
  auto first = llm::load_causal_lm(llm_dir("models/llama_gqa"));
  llm::QLoRAOptions o = corda_options();
  llm::CordaData data = llm::corda_samples_in_order(examples, 0);
  data.covariance_file = path;
  llm::apply_qlora_corda(*first, o, data);
  REQUIRE(std::filesystem::exists(path));
  // Read back: each layer's, k and v sharing q's tensor as collected.
  const std::vector<Tensor> computed =
      llm::corda_covariances(*llm::load_causal_lm(llm_dir("models/llama_gqa")), kLayer0, data);
  int64_t samples = 0;
  const std::vector<Tensor> read =
      llm::load_corda_covariances(path, kLayer0, Device::cpu(), &samples);
  CHECK(samples == 6);
  for (std::size_t i = 0; i < kLayer0.size(); ++i) CHECK(max_abs(read[i] - computed[i]) == 0);
  CHECK(read[2].storage() == read[0].storage());
  CHECK(read[5].storage() == read[4].storage());
  // A second run reads the file, not the samples: the same start.
  auto second = llm::load_causal_lm(llm_dir("models/llama_gqa"));
  llm::CordaData no_samples;
  no_samples.covariance_file = path;
  llm::apply_qlora_corda(*second, o, no_samples);
  const auto a = llm::lora_layers(*first), b = llm::lora_layers(*second);
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CHECK(max_abs(a[i].second->lora_A() - b[i].second->lora_A()) == 0);
    CHECK(max_abs(a[i].second->lora_B() - b[i].second->lora_B()) == 0);
  }
  // Files that do not fit are refused naming the file and what is wrong.
  CHECK_THROWS_WITH_AS(llm::load_corda_covariances(path, {"model.layers.0.mlp"}, Device::cpu()),
                       doctest::Contains("holds no input covariance for layer model.layers.0.mlp"),
                       std::invalid_argument);
  const std::string plain = dir.file("plain.safetensors");
  io::save_safetensors(plain, {{"model.layers.0.self_attn.q_proj", eye(32)}});
  CHECK_THROWS_WITH_AS(llm::load_corda_covariances(plain, kLayer0, Device::cpu()),
                       doctest::Contains("is not a CorDA covariance file"), std::invalid_argument);
  const std::string small = dir.file("small.safetensors");
  std::vector<std::string> all;
  for (const auto& [name, layer] : llm::lora_layers(*first)) all.push_back(name);
  llm::save_corda_covariances(small, all, std::vector<Tensor>(all.size(), eye(5)), 1);
  auto third = llm::load_causal_lm(llm_dir("models/llama_gqa"));
  llm::CordaData wrong;
  wrong.covariance_file = small;
  CHECK_THROWS_WITH_AS(llm::apply_qlora_corda(*third, o, wrong),
                       doctest::Contains("the input covariance of layer "
                                         "model.layers.0.self_attn.q_proj is [5, 5], the layer's "
                                         "is [32, 32]"),
                       std::invalid_argument);
  CHECK(llm::nf4_layers(*third).empty());
}
