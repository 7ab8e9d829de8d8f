// Stored tensor names to CausalLM's and back (image-text Gemma 3's two
// layouts), and the tensors a derived folder carries through unchanged.
#include "llm/model/weight_names.h"

#include <string_view>

#include "llm/model/model_folder.h"

namespace quanta::llm {
namespace {

// The hub's layout and the 5.x module tree's, as transformers renames them
// on load (its llava rules) and back on save.
constexpr std::string_view kHubDecoder = "language_model.model.";
constexpr std::string_view kModuleDecoder = "model.language_model.";
constexpr std::string_view kHubHead = "language_model.lm_head.";

}  // namespace

bool outside_decoder(std::string_view name) {
  if (name.starts_with("model.")) name.remove_prefix(6);
  for (const std::string_view module : kVisionModules)
    if (name.starts_with(module) && name.substr(module.size()).starts_with('.')) return true;
  return false;
}

std::optional<std::string> decoder_weight_name(const DecoderConfig& config,
                                               const std::string& stored) {
  if (config.image_text_config.empty()) return stored;
  if (outside_decoder(stored)) return std::nullopt;
  if (stored.starts_with(kHubDecoder))
    return std::string(kModuleDecoder) + stored.substr(kHubDecoder.size());
  if (stored.starts_with(kHubHead)) return "lm_head." + stored.substr(kHubHead.size());
  return stored;
}

StateDict decoder_weights(const DecoderConfig& config, const StateDict& stored) {
  if (config.image_text_config.empty()) return stored;
  StateDict out;
  for (const auto& [name, t] : stored)
    if (const auto renamed = decoder_weight_name(config, name)) out.push_back({*renamed, t});
  return out;
}

std::string stored_weight_name(const DecoderConfig& config, const std::string& name) {
  if (config.image_text_config.empty()) return name;
  if (name.starts_with(kModuleDecoder))
    return std::string(kHubDecoder) + name.substr(kModuleDecoder.size());
  if (name.starts_with("lm_head.")) return std::string(kHubHead) + name.substr(8);
  return name;
}

StateDict read_non_decoder_weights(const DecoderConfig& config, const std::string& dir) {
  if (config.image_text_config.empty()) return {};
  return read_model_weights(dir, [](const std::string& name) { return outside_decoder(name); });
}

}  // namespace quanta::llm
