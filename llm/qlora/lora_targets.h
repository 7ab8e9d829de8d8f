#pragma once
// Which linear layers get LoRA adapters, and with which r and alpha, as
// PEFT 0.21 decides (check_target_module_exists and get_pattern_key):
// exclude_modules first; then target_modules, a list of name suffixes or
// full names (narrowed by layers_to_transform), "all-linear", or one
// regular expression matching whole names; then rank_pattern and
// alpha_pattern, the first key matching the end of the name.
#include <cstdint>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "llm/qlora/lora_config.h"

namespace quanta::llm {

/** PEFT's rule for a list entry: `name` is `entry`, or ends with "." +
 * entry ("model.layers.0.self_attn.q_proj" ends in "q_proj" and
 * "self_attn.q_proj", not in "proj"). */
bool ends_with_part(const std::string& name, const std::string& entry);

/** One adapted layer's rank and alpha. */
struct LoraLayerSettings {
  int64_t r = 0;
  double lora_alpha = 0;
};

/** The adapter PEFT gives the linear layer called `name` (its full dotted
 * name, "model.layers.0.self_attn.q_proj"; lm_head is never one), or
 * nothing when PEFT leaves it alone. `lora` must pass check_lora_settings. */
std::optional<LoraLayerSettings> lora_layer_settings(const LoraSettings& lora,
                                                     const std::string& name);

/** True when PEFT trains the module called `name` whole: its full name ends
 * with an entry of modules_to_save, as a plain string. */
bool saved_module(const std::vector<std::string>& modules_to_save, const std::string& name);

/** What of `lora` chooses nothing among a model's linear layers `layers`
 * (full names), one line each. */
struct UnusedLoraSettings {
  /** target_modules entries (or its regex) matching no layer. */
  std::vector<std::string> targets;
  /** exclude_modules entries (or regex) that exclude no layer a target
   * names, layers_to_transform indexes no such layer has, rank_pattern and
   * alpha_pattern keys matching no adapted layer. PEFT accepts these
   * silently; a fine-tune refuses them as the typing mistakes they are. */
  std::vector<std::string> others;
};
UnusedLoraSettings unused_lora_settings(const LoraSettings& lora,
                                        const std::vector<std::string>& layers);

/** The fewest name suffixes (whole dotted parts: "q_proj",
 * "self_attn.q_proj") that name every one of `targets` and none of
 * `others` as a target_modules list (ends_with_part): PEFT's
 * _find_minimal_target_modules, which shortens a long list of full names
 * ("model.layers.0.self_attn.q_proj", ...) to what tells them apart. Each
 * target gets its shortest suffix no other module has, unless a suffix
 * kept already names it; sorted. Throws std::invalid_argument for no
 * targets, an empty one, or a name in both lists. */
std::vector<std::string> minimal_target_modules(const std::vector<std::string>& targets,
                                                const std::vector<std::string>& others);

/** `pattern` compiled as std::regex (ECMAScript), or std::invalid_argument
 * naming `field` and the pattern when it does not compile. */
std::regex lora_regex(const std::string& pattern, const std::string& field);

}  // namespace quanta::llm
