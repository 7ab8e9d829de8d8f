// Which layers get adapters, with which r and alpha: PEFT 0.21's choices on
// llama_gqa (2 decoder layers), as get_peft_model made them for the same
// LoraConfig in the peer environment, and the settings' refusals.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>

#include "llm/qlora/lora_config.h"
#include "llm/qlora/lora_targets.h"

using namespace quanta;
using llm::LoraSettings;

namespace {

// llama_gqa's linear layers but lm_head, in model order.
std::vector<std::string> gqa_layers() {
  std::vector<std::string> out;
  for (int l = 0; l < 2; ++l)
    for (const char* m : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"})
      out.push_back("model.layers." + std::to_string(l) + "." + m);
  return out;
}

// Every adapted layer with its r and scaling (alpha / r, or / sqrt(r)).
std::map<std::string, std::pair<int64_t, double>> chosen(const LoraSettings& l) {
  llm::check_lora_settings(l);
  std::map<std::string, std::pair<int64_t, double>> out;
  for (const std::string& name : gqa_layers())
    if (const auto s = llm::lora_layer_settings(l, name))
      out[name] = {s->r, s->lora_alpha / (l.use_rslora ? std::sqrt(double(s->r)) : double(s->r))};
  return out;
}

LoraSettings base_settings() {
  LoraSettings l;
  l.r = 4;
  l.lora_alpha = 8;
  return l;
}

}  // namespace

TEST_CASE("lora targets: PEFT's suffix rule, full names and all-linear") {
  CHECK(llm::ends_with_part("model.layers.0.self_attn.q_proj", "q_proj"));
  CHECK(llm::ends_with_part("model.layers.0.self_attn.q_proj", "self_attn.q_proj"));
  CHECK(llm::ends_with_part("q_proj", "q_proj"));
  CHECK_FALSE(llm::ends_with_part("model.layers.0.self_attn.xq_proj", "q_proj"));
  CHECK_FALSE(llm::ends_with_part("model.layers.0.self_attn.q_proj", "proj"));
  LoraSettings l = base_settings();
  CHECK(chosen(l).size() == 14);  // all-linear
  l.target_modules = {"q_proj", "model.layers.1.mlp.down_proj"};
  const auto c = chosen(l);
  CHECK(c.size() == 3);
  CHECK(c.count("model.layers.1.mlp.down_proj") == 1);
  CHECK(c.count("model.layers.0.mlp.down_proj") == 0);
  CHECK(llm::parse_module_names("q_proj,v_proj") == std::vector<std::string>{"q_proj", "v_proj"});
  CHECK_THROWS_WITH_AS(llm::parse_module_names("q_proj,,v_proj", "--exclude-modules"),
                       doctest::Contains("--exclude-modules \"q_proj,,v_proj\" has an empty entry"),
                       std::invalid_argument);
}

TEST_CASE("lora targets: layers_to_transform picks decoder layers, as PEFT does") {
  // LoraConfig(r=4, target_modules=["q_proj", "down_proj"], layers_to_transform=1)
  LoraSettings l = base_settings();
  l.target_modules = {"q_proj", "down_proj"};
  l.layers_to_transform = {1};
  using V = std::map<std::string, std::pair<int64_t, double>>;
  CHECK(chosen(l) == V{{"model.layers.1.self_attn.q_proj", {4, 2.0}},
                       {"model.layers.1.mlp.down_proj", {4, 2.0}}});
  // LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"],
  //   exclude_modules=["layers.0.self_attn.q_proj"], layers_to_transform=[0, 1],
  //   layers_pattern="layers")
  l.target_modules = {"q_proj", "v_proj", "o_proj"};
  l.exclude_modules = {"layers.0.self_attn.q_proj"};
  l.layers_to_transform = {0, 1};
  l.layers_pattern = {"layers"};
  CHECK(chosen(l) == V{{"model.layers.0.self_attn.v_proj", {4, 2.0}},
                       {"model.layers.0.self_attn.o_proj", {4, 2.0}},
                       {"model.layers.1.self_attn.q_proj", {4, 2.0}},
                       {"model.layers.1.self_attn.v_proj", {4, 2.0}},
                       {"model.layers.1.self_attn.o_proj", {4, 2.0}}});
  // A pattern the names do not hold leaves no index: nothing is adapted.
  l.exclude_modules = {};
  l.layers_pattern = {"h"};
  CHECK(chosen(l).empty());
  // The index is the first one, after the first pattern that matches.
  l.layers_pattern = {"blocks", "layers"};
  l.layers_to_transform = {0};
  CHECK(chosen(l).size() == 3);
  CHECK(llm::lora_layer_settings(l, "model.layers.0.experts.1.q_proj").has_value());
  CHECK_FALSE(llm::lora_layer_settings(l, "model.layers.1.experts.0.q_proj").has_value());
  l.layers_pattern = {};
  CHECK(llm::lora_layer_settings(l, "model.layers.0.experts.1.q_proj").has_value());
  CHECK_FALSE(llm::lora_layer_settings(l, "model.layers.1.experts.0.q_proj").has_value());
}

TEST_CASE("lora targets: a regex target_modules, rank_pattern and alpha_pattern, as PEFT") {
  // LoraConfig(r=4, target_modules=r".*\.(q_proj|v_proj)",
  //   rank_pattern={"layers.1.self_attn.q_proj": 6, "q_proj": 2}, alpha_pattern={"v_proj": 3})
  LoraSettings l = base_settings();
  l.target_modules = {};
  l.target_modules_regex = R"(.*\.(q_proj|v_proj))";
  l.rank_pattern = {{"layers.1.self_attn.q_proj", 6}, {"q_proj", 2}};
  l.alpha_pattern = {{"v_proj", 3}};
  using V = std::map<std::string, std::pair<int64_t, double>>;
  CHECK(chosen(l) == V{{"model.layers.0.self_attn.q_proj", {2, 4.0}},
                       {"model.layers.0.self_attn.v_proj", {4, 0.75}},
                       {"model.layers.1.self_attn.q_proj", {6, 8.0 / 6}},
                       {"model.layers.1.self_attn.v_proj", {4, 0.75}}});
  // The first key that matches wins: in the other order "q_proj" takes both.
  l.rank_pattern = {{"q_proj", 2}, {"layers.1.self_attn.q_proj", 6}};
  CHECK(chosen(l).at("model.layers.1.self_attn.q_proj").first == 2);
  // A key matches the end of the name after a dot: "proj" is not "q_proj".
  l.rank_pattern = {{"proj", 3}};
  CHECK(chosen(l).at("model.layers.0.self_attn.q_proj").first == 4);
  // The regex matches whole names.
  l.target_modules_regex = "q_proj";
  CHECK(chosen(l).empty());

  // LoraConfig(r=4, target_modules="all-linear", exclude_modules=r".*mlp.*", use_rslora=True,
  //   rank_pattern={"^model.layers.0.self_attn.k_proj": 8}): PEFT saves all-linear as every
  //   linear layer's full name, the excluded ones among them.
  l = base_settings();
  l.target_modules = gqa_layers();
  l.exclude_modules_regex = ".*mlp.*";
  l.use_rslora = true;
  l.rank_pattern = {{"^model.layers.0.self_attn.k_proj", 8}};
  const auto c = chosen(l);
  CHECK(c.size() == 8);
  CHECK(c.at("model.layers.0.self_attn.k_proj") ==
        std::pair<int64_t, double>{8, 8 / std::sqrt(8.0)});
  CHECK(c.at("model.layers.1.self_attn.k_proj") == std::pair<int64_t, double>{4, 4.0});
  CHECK(c.count("model.layers.0.mlp.up_proj") == 0);
}

TEST_CASE("lora targets: settings PEFT refuses, and regular expressions std::regex cannot read") {
  const auto refused = [](LoraSettings l, const std::string& what) {
    CHECK_THROWS_WITH_AS(llm::check_lora_settings(l), doctest::Contains(what.c_str()),
                         std::invalid_argument);
  };
  LoraSettings l = base_settings();
  l.target_modules_regex = ".*q_proj";
  refused(l, "a list of names or one regular expression, not both");
  l.target_modules = {};
  l.layers_to_transform = {0};
  refused(l, "layers_to_transform needs target_modules as a list of names");
  l = base_settings();
  l.layers_to_transform = {0};
  refused(l, "layers_to_transform needs target_modules as a list of names");  // all-linear
  l.target_modules = {"q_proj"};
  l.layers_to_transform = {-1};
  refused(l, "layers_to_transform has the negative index -1");
  l.layers_to_transform = {};
  l.layers_pattern = {"layers"};
  refused(l, "layers_pattern is given without layers_to_transform");
  l = base_settings();
  l.target_modules = {};
  l.target_modules_regex = "(?<=self_attn\\.)q_proj";
  refused(l,
          "target_modules: \"(?<=self_attn\\.)q_proj\" is not a regular expression quanta reads");
  l = base_settings();
  l.exclude_modules_regex = "mlp(";
  refused(l, "exclude_modules: \"mlp(\" is not a regular expression");
  l.exclude_modules_regex = "";
  l.rank_pattern = {{"q_proj", 0}};
  refused(l, "rank_pattern \"q_proj\" gives r 0; it must be positive");
  l.rank_pattern = {{"q_proj)", 2}};
  refused(l, "rank_pattern: \"(q_proj))\" is not a regular expression");
  l.rank_pattern = {};
  l.alpha_pattern = {{"q_proj", -1}};
  refused(l, "alpha_pattern \"q_proj\" gives lora_alpha -1");
}

TEST_CASE("lora targets: settings that choose nothing are named") {
  LoraSettings l = base_settings();
  l.target_modules = {"q_proj", "qproj"};
  l.exclude_modules = {"mlp.down_proj", "layers.0.self_attn.q_proj"};
  l.layers_to_transform = {0, 1, 7};
  l.rank_pattern = {{"q_proj", 2}, {"layers.0.self_attn.q_proj", 3}};
  l.alpha_pattern = {{"k_proj", 2}};
  const llm::UnusedLoraSettings u = llm::unused_lora_settings(l, gqa_layers());
  CHECK(u.targets ==
        std::vector<std::string>{"target_modules entry \"qproj\" matches no linear layer"});
  CHECK(u.others == std::vector<std::string>{
                        "exclude_modules entry \"mlp.down_proj\" excludes no targeted layer",
                        // layer 0's q_proj is excluded
                        "layers_to_transform has 0, the index of no targeted layer",
                        "layers_to_transform has 7, the index of no targeted layer",
                        "rank_pattern key \"layers.0.self_attn.q_proj\" gives no adapted layer its "
                        "value",
                        "alpha_pattern key \"k_proj\" gives no adapted layer its value"});
  l = base_settings();
  l.target_modules = {};
  l.target_modules_regex = "q_proj";
  CHECK(llm::unused_lora_settings(l, gqa_layers()).targets ==
        std::vector<std::string>{
            "target_modules regex \"q_proj\" matches no linear layer's full name"});
}

TEST_CASE("lora targets: adapter_config.json keeps the choice, the patterns' order too") {
  LoraSettings l = base_settings();
  l.target_modules = {"q_proj", "v_proj", "down_proj"};
  l.exclude_modules = {"layers.0.mlp.down_proj"};
  l.layers_to_transform = {0, 1};
  l.layers_pattern = {"layers"};
  l.rank_pattern = {{"v_proj", 2}, {"layers.1.self_attn.q_proj", 6}};
  l.alpha_pattern = {{"q_proj", 3.5}};
  const nlohmann::ordered_json j = llm::adapter_config_json(l, {});
  CHECK(j["rank_pattern"].dump() == R"({"v_proj":2,"layers.1.self_attn.q_proj":6})");
  CHECK(j["layers_pattern"] == "layers");
  const LoraSettings back = llm::read_adapter_config(nlohmann::ordered_json::parse(j.dump()), "a");
  CHECK(back.target_modules == l.target_modules);
  CHECK(back.exclude_modules == l.exclude_modules);
  CHECK(back.layers_to_transform == l.layers_to_transform);
  CHECK(back.layers_pattern == l.layers_pattern);
  CHECK(back.rank_pattern == l.rank_pattern);
  CHECK(back.alpha_pattern == l.alpha_pattern);

  // PEFT's forms: one index, a regex exclude, a regex target, "ALL-LINEAR".
  nlohmann::ordered_json peft = nlohmann::ordered_json::parse(
      R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
          "layers_to_transform": 1, "layers_pattern": null, "exclude_modules": ".*mlp.*",
          "rank_pattern": {"z": 2, "a": 3}, "alpha_pattern": {}})");
  LoraSettings r = llm::read_adapter_config(peft, "p");
  CHECK(r.layers_to_transform == std::vector<int64_t>{1});
  CHECK(r.exclude_modules_regex == ".*mlp.*");
  CHECK(r.rank_pattern == std::vector<std::pair<std::string, int64_t>>{{"z", 2}, {"a", 3}});
  peft["target_modules"] = ".*q_proj";
  peft["layers_to_transform"] = nullptr;
  CHECK(llm::read_adapter_config(peft, "p").target_modules_regex == ".*q_proj");
  peft["target_modules"] = "ALL-LINEAR";
  CHECK(llm::read_adapter_config(peft, "p").target_modules ==
        std::vector<std::string>{llm::kAllLinear});
  peft["rank_pattern"] = {{"q_proj", 2.5}};
  CHECK_THROWS_WITH_AS(
      llm::read_adapter_config(peft, "p/adapter_config.json"),
      doctest::Contains("p/adapter_config.json: rank_pattern \"q_proj\" must be an "
                        "integer, got 2.5"),
      std::runtime_error);
  peft["rank_pattern"] = nlohmann::ordered_json::object();
  peft["layers_to_transform"] = 0;
  CHECK_THROWS_WITH_AS(llm::read_adapter_config(peft, "p"),
                       doctest::Contains("layers_to_transform needs target_modules as a list"),
                       std::runtime_error);
}

// An image-text model's adapter_config.json: exclude_modules grows a clause
// for the vision tower and projector, which PEFT would otherwise adapt (its
// all-linear and q_proj reach them), while the decoder's choice stays.
TEST_CASE("lora targets: an image-text model's folder excludes the vision tower for PEFT") {
  const std::vector<std::string> vision = {"model.vision_tower.encoder.layers.0.self_attn.q_proj",
                                           "model.vision_tower.encoder.layers.0.mlp.fc1",
                                           "model.multi_modal_projector.linear"};
  LoraSettings all = base_settings();
  LoraSettings list = base_settings();
  list.target_modules = {"q_proj", "down_proj"};
  list.exclude_modules = {"layers.0.mlp.down_proj", "q_proj"};
  list.layers_to_transform = {0, 1};
  LoraSettings regex = base_settings();
  regex.target_modules = {};
  regex.target_modules_regex = R"(.*\.(q_proj|v_proj))";
  regex.exclude_modules_regex = R"(.*layers\.1\..*)";
  for (const LoraSettings& l : {all, list, regex}) {
    const LoraSettings text = llm::excluding_vision_modules(l);
    CHECK(text.exclude_modules.empty());
    CHECK_FALSE(text.exclude_modules_regex.empty());
    CHECK(chosen(text) == chosen(l));  // the decoder's names: the same choice
    CHECK_FALSE(chosen(l).empty());
    for (const std::string& v : vision) {
      INFO(v);
      CHECK_FALSE(llm::lora_layer_settings(text, v).has_value());
    }
  }
  // A list's entries keep their meaning: a name, or a suffix after a dot
  // ("q_proj" excludes every q_proj, not "xq_proj"), with dots literal.
  const LoraSettings text = llm::excluding_vision_modules(list);
  CHECK(llm::lora_layer_settings(list, "model.layers.1.self_attn.xq_proj").has_value() ==
        llm::lora_layer_settings(text, "model.layers.1.self_attn.xq_proj").has_value());
  LoraSettings dots = base_settings();
  dots.exclude_modules = {"layers.0.mlp.down_proj"};
  CHECK(
      llm::lora_layer_settings(llm::excluding_vision_modules(dots), "model.layers.0Xmlp.down_proj")
          .has_value());
  // Written as PEFT reads it: one string.
  CHECK(llm::adapter_config_json(text, {})["exclude_modules"].is_string());
}

TEST_CASE("minimal_target_modules: the fewest suffixes that name the targets and nothing else") {
  // PEFT's own example: the decoder's q and v, not the encoder's k.
  std::vector<std::string> targets, others;
  for (int i = 0; i < 100; ++i) {
    targets.push_back("model.decoder.layers." + std::to_string(i) + ".self_attn.q_proj");
    targets.push_back("model.decoder.layers." + std::to_string(i) + ".self_attn.v_proj");
    others.push_back("model.encoder.layers." + std::to_string(i) + ".self_attn.k_proj");
  }
  CHECK(llm::minimal_target_modules(targets, others) ==
        std::vector<std::string>{"q_proj", "v_proj"});
  // One q_proj left out (a layer EVA gave no rank): the others are named by
  // their layers, and the list still chooses exactly the targets.
  targets = gqa_layers();
  others = {"model", "model.layers", "model.layers.0", "model.layers.0.self_attn", "lm_head"};
  others.push_back(targets[7]);  // model.layers.1.self_attn.q_proj
  targets.erase(targets.begin() + 7);
  const std::vector<std::string> minimal = llm::minimal_target_modules(targets, others);
  CHECK(minimal == std::vector<std::string>{"0.self_attn.q_proj", "down_proj", "gate_proj",
                                            "k_proj", "o_proj", "up_proj", "v_proj"});
  LoraSettings l = base_settings();
  l.target_modules = minimal;
  std::vector<std::string> adapted;
  for (const auto& [name, settings] : chosen(l)) adapted.push_back(name);
  std::sort(targets.begin(), targets.end());
  CHECK(adapted == targets);
  CHECK_THROWS_WITH_AS(llm::minimal_target_modules({}, others), doctest::Contains("no targets"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(llm::minimal_target_modules({"a.b", ""}, {}),
                       doctest::Contains("an empty target"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(llm::minimal_target_modules({"a.b"}, {"a.b"}),
                       doctest::Contains("a.b is a target and not one"), std::invalid_argument);
}
