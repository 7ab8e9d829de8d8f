#include "llm/qlora/lora_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <stdexcept>
#include <string_view>

#include "llm/model/config.h"
#include "llm/model/weight_names.h"
#include "llm/qlora/lora_targets.h"

namespace quanta::llm {

using ojson = nlohmann::ordered_json;

namespace {

// The key under which an adapter folder records its base's quantization.
constexpr const char* kQuantizationKey = "quanta_base_quantization";

[[noreturn]] void adapter_config_fail(const std::string& source, const std::string& what) {
  throw std::runtime_error(source + ": " + what);
}

// True when `key` is absent, null, false, or an empty object or list: a
// PEFT option left at its default.
bool unset(const ojson& j, const char* key) {
  if (!j.contains(key)) return true;
  const ojson& v = j.at(key);
  return v.is_null() || (v.is_boolean() && !v.get<bool>()) ||
         ((v.is_object() || v.is_array()) && v.empty());
}

}  // namespace

const char* trained_biases_name(TrainedBiases b) {
  switch (b) {
    case TrainedBiases::all:
      return "all";
    case TrainedBiases::lora_only:
      return "lora_only";
    case TrainedBiases::none:
      break;
  }
  return "none";
}

TrainedBiases parse_trained_biases(const std::string& text) {
  for (TrainedBiases b : {TrainedBiases::none, TrainedBiases::all, TrainedBiases::lora_only})
    if (text == trained_biases_name(b)) return b;
  throw std::invalid_argument("bias must be none, all or lora_only, got \"" + text + "\"");
}

const char* lora_init_name(LoraInit init) {
  switch (init) {
    case LoraInit::gaussian:
      return "gaussian";
    case LoraInit::both_random:
      return "false";
    case LoraInit::loftq:
      return "loftq";
    case LoraInit::pissa:
      return "pissa";
    case LoraInit::olora:
      return "olora";
    case LoraInit::orthogonal:
      return "orthogonal";
    case LoraInit::eva:
      return "eva";
    case LoraInit::corda:
      return "corda";
    case LoraInit::kaiming_uniform:
      break;
  }
  return "true";
}

std::string lora_init_text(const LoraSettings& lora) {
  if (lora.init_lora_weights == LoraInit::pissa && lora.pissa_niter >= 0)
    return "pissa_niter_" + std::to_string(lora.pissa_niter);
  return lora_init_name(lora.init_lora_weights);
}

void set_lora_init(LoraSettings& lora, const std::string& text) {
  constexpr std::string_view niter_prefix = "pissa_niter_";
  if (text.starts_with(niter_prefix)) {
    const std::string digits = text.substr(niter_prefix.size());
    if (digits.empty() || digits.size() > 6 ||
        digits.find_first_not_of("0123456789") != std::string::npos)
      throw std::invalid_argument("init_lora_weights \"" + text +
                                  "\": pissa_niter_ takes the number of power iterations, as "
                                  "pissa_niter_4");
    lora.init_lora_weights = LoraInit::pissa;
    lora.pissa_niter = std::stoll(digits);
    return;
  }
  for (LoraInit i :
       {LoraInit::kaiming_uniform, LoraInit::gaussian, LoraInit::both_random, LoraInit::loftq,
        LoraInit::pissa, LoraInit::olora, LoraInit::orthogonal, LoraInit::eva, LoraInit::corda})
    if (text == lora_init_name(i)) {
      lora.init_lora_weights = i;
      lora.pissa_niter = -1;
      return;
    }
  throw std::invalid_argument(
      "init_lora_weights must be true, gaussian, false, loftq, pissa, pissa_niter_<N>, olora, "
      "orthogonal, eva or corda, got \"" +
      text + "\"");
}

bool takes_start_from_base(LoraInit init) {
  return init == LoraInit::pissa || init == LoraInit::olora || init == LoraInit::corda;
}

LoraSettings converted_to_lora(const LoraSettings& lora) {
  LoraSettings out = lora;
  out.init_lora_weights = LoraInit::kaiming_uniform;
  out.pissa_niter = -1;
  // scaling = alpha / r, or alpha / sqrt(r) with rsLoRA: kept as r doubles.
  const double alpha_factor = lora.use_rslora ? std::sqrt(2.0) : 2.0;
  out.r = 2 * lora.r;
  out.lora_alpha = alpha_factor * lora.lora_alpha;
  for (auto& [key, r] : out.rank_pattern) r *= 2;
  // PEFT doubles these whatever use_rslora (check_lora_settings refuses
  // rsLoRA with patterns for these starts, as PEFT's conversion does).
  for (auto& [key, a] : out.alpha_pattern) a *= 2;
  return out;
}

LoraSettings trained_from_start(const LoraSettings& converted,
                                const BaseQuantization& quantization) {
  LoraSettings out = converted;
  const auto half = [](int64_t r, const std::string& what) {
    if (r % 2 != 0)
      throw std::invalid_argument(what + " " + std::to_string(r) +
                                  " is odd: adapters saved converted from a start taken out of "
                                  "the base have twice their trained rank");
    return r / 2;
  };
  out.r = half(converted.r, "r");
  for (auto& [key, r] : out.rank_pattern) r = half(r, "rank_pattern \"" + key + "\" gives r");
  for (auto& [key, a] : out.alpha_pattern) a /= 2;
  out.lora_alpha = quantization.start_lora_alpha;
  set_lora_init(out, quantization.start_taken_out);
  return out;
}

std::vector<std::string> parse_module_names(const std::string& text, const std::string& what) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = text.find(',', start);
    const std::string entry =
        text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (entry.empty())
      throw std::invalid_argument(what + " \"" + text +
                                  "\" has an empty entry (entries are separated by single commas: "
                                  "q_proj,v_proj)");
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
  const bool regex = !l.target_modules_regex.empty();
  if (regex && !l.target_modules.empty())
    throw std::invalid_argument(
        "target_modules is a list of names or one regular expression, not both");
  if (!regex && l.target_modules.empty()) throw std::invalid_argument("target_modules is empty");
  for (const std::string& t : l.target_modules) {
    if (t.empty()) throw std::invalid_argument("target_modules has an empty entry");
    if (t == kAllLinear && l.target_modules.size() > 1)
      throw std::invalid_argument(
          "target_modules: all-linear stands alone, not beside other names");
  }
  if (regex) lora_regex(l.target_modules_regex, "target_modules");
  if (!l.exclude_modules_regex.empty()) {
    if (!l.exclude_modules.empty())
      throw std::invalid_argument(
          "exclude_modules is a list of names or one regular expression, not both");
    lora_regex(l.exclude_modules_regex, "exclude_modules");
  }
  for (const std::string& e : l.exclude_modules)
    if (e.empty()) throw std::invalid_argument("exclude_modules has an empty entry");
  for (const std::string& m : l.modules_to_save)
    if (m.empty()) throw std::invalid_argument("modules_to_save has an empty entry");
  for (const auto& [module, indices] : l.trainable_token_indices) {
    const std::string where =
        "trainable_token_indices" + (module.empty() ? std::string() : " of \"" + module + "\"");
    if (module.empty() && l.trainable_token_indices.size() > 1)
      throw std::invalid_argument("trainable_token_indices is a list or an object, not both");
    if (indices.empty()) throw std::invalid_argument(where + " is empty");
    for (std::size_t i = 0; i < indices.size(); ++i) {
      if (indices[i] < 0)
        throw std::invalid_argument(where + " has the negative index " +
                                    std::to_string(indices[i]));
      if (std::find(indices.begin(), indices.begin() + i, indices[i]) != indices.begin() + i)
        throw std::invalid_argument(where + " gives " + std::to_string(indices[i]) + " twice");
    }
  }
  // PEFT's LoraConfig refuses these combinations.
  if (l.lora_bias && l.use_dora)
    throw std::invalid_argument("lora_bias is not available with use_dora (PEFT refuses the two)");
  const bool all_linear = l.target_modules.size() == 1 && l.target_modules[0] == kAllLinear;
  if (!l.layers_to_transform.empty() && (regex || all_linear))
    throw std::invalid_argument(
        "layers_to_transform needs target_modules as a list of names (PEFT refuses it with a "
        "regular expression or all-linear)");
  if (!l.layers_pattern.empty() && l.layers_to_transform.empty())
    throw std::invalid_argument("layers_pattern is given without layers_to_transform");
  for (int64_t i : l.layers_to_transform)
    if (i < 0)
      throw std::invalid_argument("layers_to_transform has the negative index " +
                                  std::to_string(i));
  for (const std::string& p : l.layers_pattern) {
    if (p.empty()) throw std::invalid_argument("layers_pattern has an empty entry");
    lora_regex(p, "layers_pattern");
  }
  for (const auto& [key, r] : l.rank_pattern) {
    lora_regex("(" + key + ")", "rank_pattern");
    if (r <= 0)
      throw std::invalid_argument("rank_pattern \"" + key + "\" gives r " + std::to_string(r) +
                                  "; it must be positive");
  }
  for (const auto& [key, a] : l.alpha_pattern) {
    lora_regex("(" + key + ")", "alpha_pattern");
    if (!std::isfinite(a) || a <= 0)
      throw std::invalid_argument("alpha_pattern \"" + key + "\" gives lora_alpha " +
                                  std::to_string(a) + "; it must be positive");
  }
  if (l.pissa_niter >= 0 && l.init_lora_weights != LoraInit::pissa)
    throw std::invalid_argument("pissa_niter " + std::to_string(l.pissa_niter) +
                                " is given with init_lora_weights " +
                                lora_init_name(l.init_lora_weights));
  // Saved folders hold these starts converted to plain LoRA, which PEFT's
  // conversion cannot express for rsLoRA's per-layer patterns.
  if (takes_start_from_base(l.init_lora_weights) && l.use_rslora &&
      (!l.rank_pattern.empty() || !l.alpha_pattern.empty()))
    throw std::invalid_argument(std::string("init_lora_weights ") +
                                lora_init_name(l.init_lora_weights) +
                                " with use_rslora and rank_pattern or alpha_pattern: the saved "
                                "adapters cannot be converted to LoRA (PEFT refuses it too)");
  // EvaConfig's own checks.
  const EvaConfig& eva = l.eva_config;
  if (!std::isfinite(eva.rho) || eva.rho < 1)
    throw std::invalid_argument("eva_config rho must be >= 1 (1 keeps every layer's r), got " +
                                std::to_string(eva.rho));
  if (!(eva.tau >= 0 && eva.tau <= 1))
    throw std::invalid_argument("eva_config tau must be in [0, 1], got " + std::to_string(eva.tau));
  if (l.init_lora_weights == LoraInit::orthogonal) {
    if (l.r % 2 != 0)
      throw std::invalid_argument("init_lora_weights orthogonal needs an even r, got " +
                                  std::to_string(l.r));
    for (const auto& [key, r] : l.rank_pattern)
      if (r % 2 != 0)
        throw std::invalid_argument(
            "init_lora_weights orthogonal needs even ranks; rank_pattern \"" + key + "\" gives " +
            std::to_string(r));
  }
}

ojson adapter_config_json(const LoraSettings& l, const BaseQuantization& q) {
  check_lora_settings(l);
  ojson j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["base_model_name_or_path"] = l.base_model_name_or_path;
  j["r"] = l.r;
  j["lora_alpha"] = l.lora_alpha;
  j["lora_dropout"] = l.lora_dropout;
  // PEFT reads the one string "all-linear", and a list of names otherwise.
  if (!l.target_modules_regex.empty())
    j["target_modules"] = l.target_modules_regex;
  else if (l.target_modules.size() == 1 && l.target_modules[0] == kAllLinear)
    j["target_modules"] = kAllLinear;
  else
    j["target_modules"] = l.target_modules;
  j["use_rslora"] = l.use_rslora;
  j["bias"] = trained_biases_name(l.bias);
  j["fan_in_fan_out"] = false;
  j["inference_mode"] = true;
  // PEFT's value; LoftQ's adapters are recorded as its
  // replace_lora_weights_loftq leaves them (true): PEFT's "loftq" would make
  // a loader quantize and decompose the base again. PiSSA's and OLoRA's are
  // recorded by name: a loader takes the start out of the base again, as
  // PEFT's does, and then they fit (saved folders hold them converted).
  switch (l.init_lora_weights) {
    case LoraInit::both_random:
      j["init_lora_weights"] = false;
      break;
    case LoraInit::kaiming_uniform:
    case LoraInit::loftq:
      j["init_lora_weights"] = true;
      break;
    default:
      j["init_lora_weights"] = lora_init_text(l);
      break;
  }
  if (l.init_lora_weights == LoraInit::eva)
    j["eva_config"] = {{"rho", l.eva_config.rho},
                       {"tau", l.eva_config.tau},
                       {"use_label_mask", l.eva_config.use_label_mask},
                       {"label_mask_value", l.eva_config.label_mask_value},
                       {"whiten", l.eva_config.whiten},
                       {"adjust_scaling_factors", l.eva_config.adjust_scaling_factors}};
  if (l.init_lora_weights == LoraInit::corda)
    j["corda_config"] = {{"cache_file", nullptr},
                         {"covariance_file", nullptr},
                         {"corda_method", quant::corda_method_name(l.corda_config.method)},
                         {"verbose", false},
                         {"use_float16_for_covariance", false},
                         {"prune_temporary_fields", true}};
  j["use_dora"] = l.use_dora;
  j["lora_bias"] = l.lora_bias;
  j["modules_to_save"] = l.modules_to_save.empty() ? ojson() : ojson(l.modules_to_save);
  // PEFT's two forms: a list for the input embeddings, or an object by module.
  if (l.trainable_token_indices.empty()) {
    j["trainable_token_indices"] = ojson();
  } else if (l.trainable_token_indices[0].first.empty()) {
    j["trainable_token_indices"] = l.trainable_token_indices[0].second;
  } else {
    j["trainable_token_indices"] = ojson::object();
    for (const auto& [module, indices] : l.trainable_token_indices)
      j["trainable_token_indices"][module] = indices;
  }
  j["exclude_modules"] = !l.exclude_modules_regex.empty() ? ojson(l.exclude_modules_regex)
                         : l.exclude_modules.empty()      ? ojson()
                                                          : ojson(l.exclude_modules);
  j["layers_to_transform"] = l.layers_to_transform.empty() ? ojson() : ojson(l.layers_to_transform);
  j["layers_pattern"] = l.layers_pattern.empty()       ? ojson()
                        : l.layers_pattern.size() == 1 ? ojson(l.layers_pattern[0])
                                                       : ojson(l.layers_pattern);
  // In training order: PEFT takes the first matching key in the file's.
  j["rank_pattern"] = ojson::object();
  for (const auto& [key, r] : l.rank_pattern) j["rank_pattern"][key] = r;
  j["alpha_pattern"] = ojson::object();
  for (const auto& [key, a] : l.alpha_pattern) j["alpha_pattern"][key] = a;
  j[kQuantizationKey] = {{"quant_type", "nf4"},
                         {"blocksize", q.blocksize},
                         {"double_quant", q.double_quant},
                         {"compute_dtype", torch_dtype_name(q.compute_dtype)}};
  if (!q.start_taken_out.empty())
    j[kQuantizationKey]["start_taken_out"] = {{"init_lora_weights", q.start_taken_out},
                                              {"lora_alpha", q.start_lora_alpha}};
  return j;
}

LoraSettings excluding_vision_modules(const LoraSettings& lora) {
  // Joined by position: a string literal's address may differ between
  // translation units (an ASan build keeps the copies apart).
  std::string vision = R"(model\.(?:)";
  for (std::size_t i = 0; i < kVisionModules.size(); ++i)
    vision.append(i > 0 ? "|" : "").append(kVisionModules[i]);
  vision.append(R"()\..*)");
  LoraSettings out = lora;
  // Appended piece by piece: names, each escaped, as PEFT's list matches
  // them (the whole name, or a suffix after a dot).
  std::string re;
  if (!lora.exclude_modules_regex.empty()) {
    re.append("(?:").append(lora.exclude_modules_regex).append(")|");
  } else if (!lora.exclude_modules.empty()) {
    re.append("(?:.*\\.)?(?:");
    for (std::size_t i = 0; i < lora.exclude_modules.size(); ++i) {
      if (i > 0) re.push_back('|');
      for (char ch : lora.exclude_modules[i]) {
        if (std::string_view("\\^$.|?*+()[]{}").find(ch) != std::string_view::npos)
          re.push_back('\\');
        re.push_back(ch);
      }
    }
    re.append(")|");
  }
  out.exclude_modules_regex = re.append(vision);
  out.exclude_modules.clear();
  return out;
}

LoraSettings read_adapter_config(const ojson& j, const std::string& source) {
  if (!j.is_object()) adapter_config_fail(source, "is not a JSON object");
  const ojson peft_type = j.value("peft_type", ojson());
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
  for (const char* key : {"fan_in_fan_out", "layer_replication", "target_parameters", "use_qalora"})
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
  LoraSettings l;
  if (j.contains("bias") && !j.at("bias").is_null()) {
    const ojson& b = j.at("bias");
    if (!b.is_string()) adapter_config_fail(source, "bias must be a string, got " + b.dump());
    try {
      l.bias = parse_trained_biases(b.get<std::string>());
    } catch (const std::invalid_argument& e) {
      adapter_config_fail(source, e.what());
    }
  }
  for (const char* key : {"use_dora", "lora_bias"})
    if (j.contains(key) && !j.at(key).is_null() && !j.at(key).is_boolean())
      adapter_config_fail(source,
                          std::string(key) + " must be true or false, got " + j.at(key).dump());
  if (j.contains("r") && j.at("r").is_number() && !j.at("r").is_number_integer())
    adapter_config_fail(source, "\"r\" must be an integer, got " + j.at("r").dump());
  try {
    l.r = j.at("r").get<int64_t>();
    l.lora_alpha = j.at("lora_alpha").get<double>();
    l.lora_dropout = j.value("lora_dropout", 0.0);
    l.use_rslora = j.value("use_rslora", false);
    l.use_dora =
        j.contains("use_dora") && !j.at("use_dora").is_null() && j.at("use_dora").get<bool>();
    l.lora_bias =
        j.contains("lora_bias") && !j.at("lora_bias").is_null() && j.at("lora_bias").get<bool>();
    const ojson& tm = j.at("target_modules");
    if (tm.is_string()) {
      std::string lower = tm.get<std::string>();
      std::transform(lower.begin(), lower.end(), lower.begin(),
                     [](unsigned char c) { return std::tolower(c); });
      if (lower == kAllLinear) {
        l.target_modules = {kAllLinear};
      } else {
        l.target_modules.clear();
        l.target_modules_regex = tm.get<std::string>();
      }
    } else {
      l.target_modules = tm.get<std::vector<std::string>>();
    }
    // PEFT's fields that are a list or one string (a regular expression
    // for exclude_modules, a name for layers_pattern), an index or a list.
    if (!unset(j, "exclude_modules")) {
      const ojson& e = j.at("exclude_modules");
      if (e.is_string())
        l.exclude_modules_regex = e.get<std::string>();
      else
        l.exclude_modules = e.get<std::vector<std::string>>();
    }
    if (!unset(j, "modules_to_save"))
      l.modules_to_save = j.at("modules_to_save").get<std::vector<std::string>>();
    if (!unset(j, "trainable_token_indices")) {
      const ojson& t = j.at("trainable_token_indices");
      const auto token_indices = [&](const ojson& v, const std::string& what) {
        if (!v.is_array())
          adapter_config_fail(source, what + " must be a list of token indices, got " + v.dump());
        std::vector<int64_t> out;
        for (const ojson& e : v) {
          if (!e.is_number_integer())
            adapter_config_fail(source, what + " holds " + e.dump() + ", not a token index");
          out.push_back(e.get<int64_t>());
        }
        return out;
      };
      if (t.is_array())
        l.trainable_token_indices.emplace_back("", token_indices(t, "trainable_token_indices"));
      else if (t.is_object())
        for (const auto& [module, indices] : t.items())
          l.trainable_token_indices.emplace_back(
              module, token_indices(indices, "trainable_token_indices \"" + module + "\""));
      else
        adapter_config_fail(source,
                            "trainable_token_indices must be a list or an object, got " + t.dump());
    }
    if (j.contains("layers_to_transform") && !j.at("layers_to_transform").is_null()) {
      const ojson& t = j.at("layers_to_transform");
      if (t.is_number_integer())
        l.layers_to_transform = {t.get<int64_t>()};
      else
        l.layers_to_transform = t.get<std::vector<int64_t>>();
    }
    if (!unset(j, "layers_pattern") && j.at("layers_pattern") != "") {
      const ojson& p = j.at("layers_pattern");
      if (p.is_string())
        l.layers_pattern = {p.get<std::string>()};
      else
        l.layers_pattern = p.get<std::vector<std::string>>();
    }
    for (const char* key : {"rank_pattern", "alpha_pattern"})
      if (j.contains(key) && !j.at(key).is_null() && !j.at(key).is_object())
        adapter_config_fail(source,
                            std::string(key) + " must be an object, got " + j.at(key).dump());
    if (j.contains("rank_pattern") && j.at("rank_pattern").is_object())
      for (const auto& [key, r] : j.at("rank_pattern").items()) {
        if (!r.is_number_integer())
          adapter_config_fail(source,
                              "rank_pattern \"" + key + "\" must be an integer, got " + r.dump());
        l.rank_pattern.emplace_back(key, r.get<int64_t>());
      }
    if (j.contains("alpha_pattern") && j.at("alpha_pattern").is_object())
      for (const auto& [key, a] : j.at("alpha_pattern").items()) {
        if (!a.is_number())
          adapter_config_fail(source,
                              "alpha_pattern \"" + key + "\" must be a number, got " + a.dump());
        l.alpha_pattern.emplace_back(key, a.get<double>());
      }
    const ojson& base = j.value("base_model_name_or_path", ojson());
    l.base_model_name_or_path = base.is_string() ? base.get<std::string>() : "";
    // Adapters trained from PiSSA's or OLoRA's start (unconverted) fit the
    // base with that start taken out: PEFT's loader takes it out again, and
    // so does apply_qlora with these. Other starts only set values the
    // stored tensors replace.
    const ojson& init = j.value("init_lora_weights", ojson());
    if (init.is_string()) {
      const std::string text = init.get<std::string>();
      if (text == "olora" || text.starts_with("pissa")) try {
          set_lora_init(l, text);
        } catch (const std::invalid_argument& e) {
          adapter_config_fail(source, e.what());
        }
      // Unconverted adapters trained from CorDA's start fit a base with it
      // taken out, which takes the covariances of the data it came from
      // (PEFT's loader fails without preprocess_corda too).
      if (text == "corda")
        adapter_config_fail(
            source,
            "init_lora_weights corda: these adapters fit a base with CorDA's start taken out, "
            "which needs the input covariances of the samples it was computed from; save them "
            "converted to LoRA (PEFT's path_initial_model_for_weight_conversion, as quanta "
            "finetune does) to read them over the original weights");
      // EVA's start is only the stored A's, read as they are; the
      // settings are kept so that a folder written again says the same.
      if (text == "eva") {
        l.init_lora_weights = LoraInit::eva;
        const ojson& eva = j.value("eva_config", ojson());
        if (eva.is_object()) {
          l.eva_config.rho = eva.value("rho", l.eva_config.rho);
          l.eva_config.tau = eva.value("tau", l.eva_config.tau);
          l.eva_config.use_label_mask = eva.value("use_label_mask", l.eva_config.use_label_mask);
          l.eva_config.label_mask_value =
              eva.value("label_mask_value", l.eva_config.label_mask_value);
          l.eva_config.whiten = eva.value("whiten", l.eva_config.whiten);
          l.eva_config.adjust_scaling_factors =
              eva.value("adjust_scaling_factors", l.eva_config.adjust_scaling_factors);
        } else if (!eva.is_null()) {
          adapter_config_fail(source, "eva_config must be an object, got " + eva.dump());
        }
      }
    }
  } catch (const ojson::exception& e) {
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

BaseQuantization read_base_quantization(const ojson& j, const std::string& source,
                                        DType model_dtype) {
  BaseQuantization q;
  if (!j.contains(kQuantizationKey)) {
    q.compute_dtype = model_dtype == DType::f64 ? DType::f32 : model_dtype;
    return q;
  }
  const ojson& r = j.at(kQuantizationKey);
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
    if (r.contains("start_taken_out")) {
      const ojson& start = r.at("start_taken_out");
      const std::string where = std::string(kQuantizationKey) + ".start_taken_out";
      if (!start.is_object() || !start.contains("init_lora_weights") ||
          !start.at("init_lora_weights").is_string() || !start.contains("lora_alpha") ||
          !start.at("lora_alpha").is_number())
        adapter_config_fail(source, where +
                                        " must be an object with init_lora_weights (a string) "
                                        "and lora_alpha (a number), got " +
                                        start.dump());
      q.start_taken_out = start.at("init_lora_weights").get<std::string>();
      q.start_lora_alpha = start.at("lora_alpha").get<double>();
      LoraSettings check;
      set_lora_init(check, q.start_taken_out);
      if (!takes_start_from_base(check.init_lora_weights))
        adapter_config_fail(source, where +
                                        ".init_lora_weights must be pissa, pissa_niter_<N>, "
                                        "olora or corda, got \"" +
                                        q.start_taken_out + "\"");
    }
  } catch (const std::exception& e) {
    if (dynamic_cast<const std::runtime_error*>(&e)) throw;
    adapter_config_fail(source, std::string(kQuantizationKey) + ": " + e.what());
  }
  return q;
}

}  // namespace quanta::llm
