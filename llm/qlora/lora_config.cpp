#include "llm/qlora/lora_config.h"

#include <cmath>
#include <stdexcept>

#include "llm/model/config.h"

namespace quanta::llm {

using nlohmann::json;

namespace {

// The key under which an adapter folder records its base's quantization.
constexpr const char* kQuantizationKey = "quanta_base_quantization";

[[noreturn]] void adapter_config_fail(const std::string& source, const std::string& what) {
  throw std::runtime_error(source + ": " + what);
}

// True when `key` is absent, null, false, or an empty object or list: a
// PEFT option left at its default.
bool unset(const json& j, const char* key) {
  if (!j.contains(key)) return true;
  const json& v = j.at(key);
  return v.is_null() || (v.is_boolean() && !v.get<bool>()) ||
         ((v.is_object() || v.is_array()) && v.empty());
}

}  // namespace

std::vector<std::string> parse_target_modules(const std::string& text) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = text.find(',', start);
    const std::string entry =
        text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (entry.empty())
      throw std::invalid_argument("target modules \"" + text +
                                  "\" has an empty entry (write q_proj,v_proj or all-linear)");
    out.push_back(entry);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

void check_lora_settings(const LoraSettings& l) {
  if (l.r <= 0) throw std::invalid_argument("lora r must be positive, got " + std::to_string(l.r));
  if (!std::isfinite(l.lora_alpha) || l.lora_alpha <= 0)
    throw std::invalid_argument("lora_alpha must be positive, got " + std::to_string(l.lora_alpha));
  if (!(l.lora_dropout >= 0 && l.lora_dropout < 1))
    throw std::invalid_argument("lora_dropout must be in [0, 1), got " +
                                std::to_string(l.lora_dropout));
  if (l.target_modules.empty()) throw std::invalid_argument("target_modules is empty");
  for (const std::string& t : l.target_modules) {
    if (t.empty()) throw std::invalid_argument("target_modules has an empty entry");
    if (t == kAllLinear && l.target_modules.size() > 1)
      throw std::invalid_argument(
          "target_modules: all-linear stands alone, not beside other names");
  }
}

json adapter_config_json(const LoraSettings& l, const BaseQuantization& q) {
  check_lora_settings(l);
  json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["base_model_name_or_path"] = l.base_model_name_or_path;
  j["r"] = l.r;
  j["lora_alpha"] = l.lora_alpha;
  j["lora_dropout"] = l.lora_dropout;
  // PEFT reads the one string "all-linear", and a list of names otherwise.
  if (l.target_modules.size() == 1 && l.target_modules[0] == kAllLinear)
    j["target_modules"] = kAllLinear;
  else
    j["target_modules"] = l.target_modules;
  j["use_rslora"] = l.use_rslora;
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  j["use_dora"] = false;
  j["modules_to_save"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["layers_pattern"] = nullptr;
  j["rank_pattern"] = json::object();
  j["alpha_pattern"] = json::object();
  j[kQuantizationKey] = {{"quant_type", "nf4"},
                         {"blocksize", q.blocksize},
                         {"double_quant", q.double_quant},
                         {"compute_dtype", torch_dtype_name(q.compute_dtype)}};
  return j;
}

LoraSettings read_adapter_config(const json& j, const std::string& source) {
  if (!j.is_object()) adapter_config_fail(source, "is not a JSON object");
  const json peft_type = j.value("peft_type", json());
  if (peft_type != "LORA")
    adapter_config_fail(source,
                        "peft_type is " + peft_type.dump() + "; only LORA adapters are read");
  if (j.contains("task_type") && !j.at("task_type").is_null() && j.at("task_type") != "CAUSAL_LM")
    adapter_config_fail(source, "task_type is " + j.at("task_type").dump() + ", not CAUSAL_LM");
  // Options that change what the adapters compute, which this library does
  // not implement: refused by name rather than silently computed otherwise
  // (PEFT 0.21's list; the initialisation-only ones, such as loftq_config or
  // eva_config, and velora_config, a backward that stores less, are read as
  // plain LoRA, as PEFT reads them once trained).
  for (const char* key :
       {"use_dora", "fan_in_fan_out", "modules_to_save", "layers_to_transform", "rank_pattern",
        "alpha_pattern", "layer_replication", "trainable_token_indices", "lora_bias",
        "exclude_modules", "target_parameters", "use_qalora"})
    if (!unset(j, key))
      adapter_config_fail(source, std::string(key) + " is set (" + j.at(key).dump() +
                                      "); quanta reads adapters without it");
  // These are on whenever not null: PEFT turns {} into a config with its
  // defaults, and takes [] invocation tokens as aLoRA on 4-bit layers.
  for (const char* key : {"alora_invocation_tokens", "kasa_config", "monteclora_config",
                          "use_bdlora", "arrow_config"})
    if (j.contains(key) && !j.at(key).is_null() && j.at(key) != false)
      adapter_config_fail(source, std::string(key) + " is set (" + j.at(key).dump() +
                                      "); quanta reads adapters without it");
  if (j.contains("bias") && j.at("bias") != "none")
    adapter_config_fail(
        source, "bias is " + j.at("bias").dump() + "; quanta reads adapters with bias \"none\"");
  LoraSettings l;
  if (j.contains("r") && j.at("r").is_number() && !j.at("r").is_number_integer())
    adapter_config_fail(source, "\"r\" must be an integer, got " + j.at("r").dump());
  try {
    l.r = j.at("r").get<int64_t>();
    l.lora_alpha = j.at("lora_alpha").get<double>();
    l.lora_dropout = j.value("lora_dropout", 0.0);
    l.use_rslora = j.value("use_rslora", false);
    const json& tm = j.at("target_modules");
    if (tm.is_string()) {
      if (tm.get<std::string>() != kAllLinear)
        adapter_config_fail(source, "target_modules is the regular expression " + tm.dump() +
                                        "; quanta reads a list of module names or \"all-linear\"");
      l.target_modules = {kAllLinear};
    } else {
      l.target_modules = tm.get<std::vector<std::string>>();
    }
    const json& base = j.value("base_model_name_or_path", json());
    l.base_model_name_or_path = base.is_string() ? base.get<std::string>() : "";
  } catch (const json::exception& e) {
    adapter_config_fail(source,
                        std::string("a LoRA field is missing or of the wrong type: ") + e.what());
  }
  try {
    check_lora_settings(l);
  } catch (const std::invalid_argument& e) {
    adapter_config_fail(source, e.what());
  }
  return l;
}

BaseQuantization read_base_quantization(const json& j, const std::string& source,
                                        DType model_dtype) {
  BaseQuantization q;
  if (!j.contains(kQuantizationKey)) {
    q.compute_dtype = model_dtype == DType::f64 ? DType::f32 : model_dtype;
    return q;
  }
  const json& r = j.at(kQuantizationKey);
  if (!r.is_object())
    adapter_config_fail(source, std::string(kQuantizationKey) + " must be an object");
  try {
    if (r.value("quant_type", std::string("nf4")) != "nf4")
      adapter_config_fail(source, std::string(kQuantizationKey) + ".quant_type must be nf4");
    if (r.contains("blocksize") && !r.at("blocksize").is_number_integer())
      adapter_config_fail(source, std::string(kQuantizationKey) + ".blocksize must be an integer");
    q.blocksize = r.value("blocksize", q.blocksize);
    // bitsandbytes' block sizes.
    if (q.blocksize != 32 && !(q.blocksize >= 64 && q.blocksize <= 4096 && q.blocksize % 64 == 0))
      adapter_config_fail(source, std::string(kQuantizationKey) +
                                      ".blocksize must be 32 or a multiple of 64 up "
                                      "to 4096, got " +
                                      std::to_string(q.blocksize));
    q.double_quant = r.value("double_quant", q.double_quant);
    q.compute_dtype = dtype_from_torch_name(r.value("compute_dtype", std::string("bfloat16")));
  } catch (const std::exception& e) {
    if (dynamic_cast<const std::runtime_error*>(&e)) throw;
    adapter_config_fail(source, std::string(kQuantizationKey) + ": " + e.what());
  }
  return q;
}

}  // namespace quanta::llm
