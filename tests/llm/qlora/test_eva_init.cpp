// EVA's start (llm/qlora/eva_init.h) beyond the PEFT parity cases
// (test_qlora_parity.cpp): rho 1 keeps every r, shared inputs, whitening,
// a 4-bit folder's base the same as the float folder's, the settings in
// adapter_config.json and back, and the refusals, which leave every layer
// in place.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "engine/factory.h"
#include "llm/data/lm_examples.h"
#include "llm/model/config.h"
#include "llm/model/model_folder.h"
#include "llm/qlora/bnb_folder.h"
#include "llm/qlora/eva_init.h"
#include "llm/qlora/lora_config.h"
#include "llm/qlora/lora_targets.h"
#include "llm/qlora/qlora_model.h"
#include "random_windows.h"
#include "support/relative_error.h"
#include "support/test_data.h"

using namespace quanta;
using namespace quanta::testing;

namespace {

std::string llm_dir(const std::string& name) { return quanta::testing::test_data("llm/" + name); }

// `rows` examples a batch, in order, each SVD exact.
llm::EvaData batches_of(const llm::LmExamples& examples, int64_t rows) {
  llm::EvaData data = llm::eva_batches_in_order(examples, rows);
  data.svd_niter = -1;
  return data;
}

llm::QLoRAOptions eva_options(double rho = 2) {
  llm::QLoRAOptions o;
  o.lora.r = 4;
  o.lora.lora_alpha = 8;
  llm::set_lora_init(o.lora, "eva");
  o.lora.eva_config.rho = rho;
  o.quantization.compute_dtype = DType::f32;
  return o;
}

}  // namespace

TEST_CASE("EVA: rho 1 keeps every r; layers reading one input share its components") {
  const llm::LmExamples examples = random_windows(24, 16, 1);
  auto model = llm::load_causal_lm(llm_dir("models/llama_gqa"));
  llm::QLoRAOptions o = eva_options(1);
  llm::EvaStarts starts;
  const llm::QLoRAReport report = llm::apply_qlora_eva(*model, o, batches_of(examples, 4), &starts);
  CHECK(report.layers.size() == 14);
  CHECK(o.lora.rank_pattern.empty());
  CHECK(o.lora.alpha_pattern.empty());
  CHECK(o.lora.target_modules.size() == 14);
  CHECK(o.given_lora_A.size() == 14);
  MESSAGE("rho 1: " << starts.forwards << " forward passes, " << starts.positions << " positions");
  CHECK(starts.forwards >= 3);  // the shared inputs' pass, then two fits at least
  CHECK(starts.positions % (4 * 16) == 0);
  std::map<std::string, const llm::EvaLayer*> by_name;
  for (const llm::EvaLayer& l : starts.layers) by_name[l.name] = &l;
  for (const int layer : {0, 1}) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    CHECK(by_name.at(p + "self_attn.q_proj")->input_of.empty());
    CHECK(by_name.at(p + "self_attn.k_proj")->input_of == p + "self_attn.q_proj");
    CHECK(by_name.at(p + "self_attn.v_proj")->input_of == p + "self_attn.q_proj");
    CHECK(by_name.at(p + "self_attn.o_proj")->input_of.empty());
    CHECK(by_name.at(p + "mlp.up_proj")->input_of == p + "mlp.gate_proj");
    CHECK(by_name.at(p + "mlp.down_proj")->input_of.empty());
    // Shared, the same components.
    CHECK(max_abs(by_name.at(p + "self_attn.v_proj")->lora_A -
                  by_name.at(p + "self_attn.q_proj")->lora_A) == 0);
  }
  for (const auto& [name, layer] : llm::lora_layers(*model)) {
    INFO(name);
    CHECK(layer->lora_A().shape() == Shape{4, layer->base()->in_features()});
    CHECK(max_abs(layer->lora_B()) == 0);
    CHECK(layer->scaling() == 2.0);
    // Principal directions: orthonormal rows.
    const Tensor a = layer->lora_A().to(DType::f64);
    CHECK(max_abs(matmul(a, transpose(a, 0, 1)) - eye(4, -1, {.dtype = DType::f64})) < 1e-6);
  }
}

TEST_CASE("EVA: whitened rows are the components over the square roots of their values") {
  const llm::LmExamples examples = random_windows(24, 16, 2);
  auto plain = llm::load_causal_lm(llm_dir("models/llama_gqa"));
  auto whitened = llm::load_causal_lm(llm_dir("models/llama_gqa"));
  llm::QLoRAOptions o = eva_options();
  llm::EvaStarts a, b;
  llm::apply_qlora_eva(*plain, o, batches_of(examples, 4), &a);
  llm::QLoRAOptions w = eva_options();
  w.lora.eva_config.whiten = true;
  llm::apply_qlora_eva(*whitened, w, batches_of(examples, 4), &b);
  REQUIRE(a.layers.size() == b.layers.size());
  for (std::size_t i = 0; i < a.layers.size(); ++i) {
    INFO(a.layers[i].name);
    CHECK(a.layers[i].r == b.layers[i].r);
    if (a.layers[i].r == 0) continue;
    // Row by row a positive multiple, the same for every layer of one input.
    const Tensor ratio = b.layers[i].lora_A / a.layers[i].lora_A;
    const Tensor per_row = mean(ratio, {1}, true);
    CHECK(max_rel_diff(ratio, per_row.expand(ratio.shape())) < 1e-9);
    CHECK(min(per_row).item() > 0);
  }
}

TEST_CASE("EVA over a 4-bit folder starts as over the float folder it was quantized from") {
  const llm::LmExamples examples = random_windows(24, 16, 3);
  auto from_float = llm::load_causal_lm(llm_dir("models/llama_gqa"));
  auto four_bit = llm::load_base_model(llm_dir("qlora/transformers_4bit/llama_gqa"));
  llm::QLoRAOptions a = eva_options(), b = eva_options();
  llm::EvaStarts sa, sb;
  llm::apply_qlora_eva(*from_float, a, batches_of(examples, 4), &sa);
  llm::apply_qlora_eva(*four_bit, b, batches_of(examples, 4), &sb);
  CHECK(a.lora.rank_pattern == b.lora.rank_pattern);
  CHECK(a.lora.alpha_pattern == b.lora.alpha_pattern);
  CHECK(sa.forwards == sb.forwards);
  const auto la = llm::lora_layers(*from_float), lb = llm::lora_layers(*four_bit);
  REQUIRE(la.size() == lb.size());
  for (std::size_t i = 0; i < la.size(); ++i)
    CHECK(max_abs(la[i].second->lora_A() - lb[i].second->lora_A()) == 0);
}

TEST_CASE("EVA's settings in adapter_config.json, and apply_qlora without data") {
  llm::LoraSettings l;
  llm::set_lora_init(l, "eva");
  l.eva_config = {.rho = 1.5,
                  .tau = 0.95,
                  .use_label_mask = false,
                  .label_mask_value = -1,
                  .whiten = true,
                  .adjust_scaling_factors = false};
  const nlohmann::ordered_json j = llm::adapter_config_json(l, {});
  CHECK(j["init_lora_weights"] == "eva");
  CHECK(j["eva_config"]["rho"] == 1.5);
  const llm::LoraSettings back = llm::read_adapter_config(j, "adapter_config.json");
  CHECK(back.init_lora_weights == llm::LoraInit::eva);
  CHECK(back.eva_config.rho == 1.5);
  CHECK(back.eva_config.tau == 0.95);
  CHECK_FALSE(back.eva_config.use_label_mask);
  CHECK(back.eva_config.label_mask_value == -1);
  CHECK(back.eva_config.whiten);
  CHECK_FALSE(back.eva_config.adjust_scaling_factors);
  // Other starts write no eva_config.
  CHECK_FALSE(llm::adapter_config_json(llm::LoraSettings{}, {}).contains("eva_config"));
  // PEFT's checks of EvaConfig.
  l.eva_config.rho = 0.5;
  CHECK_THROWS_WITH_AS(llm::check_lora_settings(l), doctest::Contains("rho must be >= 1"),
                       std::invalid_argument);
  l.eva_config.rho = 2;
  l.eva_config.tau = 1.5;
  CHECK_THROWS_WITH_AS(llm::check_lora_settings(l), doctest::Contains("tau must be in [0, 1]"),
                       std::invalid_argument);
  // Without data, apply_qlora starts EVA's adapters as PEFT's model does
  // before initialize_lora_eva_weights: A drawn, B zero.
  auto model = llm::load_causal_lm(llm_dir("models/llama_gqa"));
  llm::QLoRAOptions o = eva_options();
  llm::apply_qlora(*model, o);
  for (const auto& [name, layer] : llm::lora_layers(*model)) {
    CHECK(max_abs(layer->lora_A()) > 0);
    CHECK(max_abs(layer->lora_B()) == 0);
  }
}

TEST_CASE("EVA's refusals name the problem and leave every layer in place") {
  const llm::LmExamples examples = random_windows(24, 16, 4);
  auto model = llm::load_causal_lm(llm_dir("models/llama_gqa"));
  llm::QLoRAOptions o = eva_options();
  o.lora.init_lora_weights = llm::LoraInit::pissa;
  CHECK_THROWS_WITH_AS(llm::apply_qlora_eva(*model, o, batches_of(examples, 4)),
                       doctest::Contains("init_lora_weights is pissa, not eva"),
                       std::invalid_argument);
  // round(4 x 9) = 36 components of 32 features: refused before anything
  // is quantized.
  o = eva_options(9);
  CHECK_THROWS_WITH_AS(
      llm::apply_qlora_eva(*model, o, batches_of(examples, 4)),
      doctest::Contains("may take 36 components (round(r x rho), rho 9), more than "
                        "its 32 input features"),
      std::invalid_argument);
  CHECK(llm::nf4_layers(*model).empty());
  o = eva_options();
  CHECK_THROWS_WITH_AS(llm::apply_qlora_eva(*model, o, llm::EvaData{}),
                       doctest::Contains("at least one batch"), std::invalid_argument);

  // The rest over the NF4 base.
  llm::QLoRAOptions base = eva_options();
  llm::quantize_base(*model, base.quantization);
  const std::vector<llm::EvaTarget> targets = {{"model.layers.0.self_attn.q_proj", 4, 8},
                                               {"model.layers.1.mlp.down_proj", 4, 8}};
  const auto layers_in_place = [&] {
    CHECK(llm::nf4_layers(*model).size() == 14);
    CHECK(llm::lora_layers(*model).empty());
  };
  llm::EvaData data = batches_of(examples, 4);
  data.max_forwards = 2;
  CHECK_THROWS_WITH_AS(llm::eva_starts(*model, targets, {}, data),
                       doctest::Contains("after 2 forward passes over 6 batches, the inputs of "
                                         "model.layers.0.self_attn.q_proj, "
                                         "model.layers.1.mlp.down_proj have not converged (tau"),
                       std::invalid_argument);
  layers_in_place();
  // Two positions a batch, fewer than 8 components: never fitted.
  const llm::LmExamples short_rows = random_windows(6, 2, 5);
  data = batches_of(short_rows, 1);
  data.max_forwards = 4;
  CHECK_THROWS_WITH_AS(llm::eva_starts(*model, targets, {}, data),
                       doctest::Contains("never fitted: fewer positions than its 8 components "
                                         "in every batch"),
                       std::invalid_argument);
  layers_in_place();
  CHECK_THROWS_WITH_AS(
      llm::eva_starts(*model, {{"model.layers.0.mlp", 4, 8}}, {}, batches_of(examples, 4)),
      doctest::Contains("model.layers.0.mlp is not a linear layer"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(
      llm::eva_starts(*model, {{"model.layers.0.mlp.up_proj", 0, 8}}, {}, batches_of(examples, 4)),
      doctest::Contains("has r 0"), std::invalid_argument);
  layers_in_place();

  // apply_qlora's check of given starts, before anything is converted.
  llm::QLoRAOptions given = eva_options();
  given.given_lora_A["model.layers.0.mlp"] = zeros({4, 32});
  CHECK_THROWS_WITH_AS(llm::apply_qlora(*model, given),
                       doctest::Contains("a lora_A is given for model.layers.0.mlp, which is not "
                                         "an adapted layer"),
                       std::invalid_argument);
  given.given_lora_A.clear();
  given.given_lora_A["model.layers.0.mlp.down_proj"] = zeros({4, 32});
  CHECK_THROWS_WITH_AS(llm::apply_qlora(*model, given),
                       doctest::Contains("the lora_A given for model.layers.0.mlp.down_proj is "
                                         "[4, 32], its adapter's is [4, 48]"),
                       std::invalid_argument);
  layers_in_place();
}

TEST_CASE("EVA over 20 layers or more: target_modules shortened as PEFT does, the same layers") {
  // llama_gqa's shape with three decoder layers: 21 linear layers.
  llm::DecoderConfig config = llm::read_decoder_config(llm_dir("models/llama_gqa/config.json"));
  config.num_hidden_layers = 3;
  Generator gen(6);
  auto model = llm::CausalLM::random(config, gen, Device::cpu(), 0.5);
  const llm::LmExamples examples = random_windows(24, 16, 6);
  llm::QLoRAOptions o = eva_options();
  llm::EvaStarts starts;
  llm::apply_qlora_eva(*model, o, batches_of(examples, 4), &starts);
  REQUIRE(starts.layers.size() == 21);
  std::vector<std::string> with_rank;
  for (const llm::EvaLayer& l : starts.layers)
    if (l.r > 0) with_rank.push_back(l.name);
  MESSAGE("21 layers, " << with_rank.size() << " with a rank; target_modules "
                        << nlohmann::json(o.lora.target_modules).dump());
  CHECK(o.lora.target_modules.size() < with_rank.size());
  // The short list chooses exactly the layers with a rank.
  std::vector<std::string> adapted;
  for (const auto& [name, layer] : llm::lora_layers(*model)) adapted.push_back(name);
  CHECK(adapted == with_rank);
  for (const auto& name : with_rank) CHECK(llm::lora_layer_settings(o.lora, name).has_value());
}
