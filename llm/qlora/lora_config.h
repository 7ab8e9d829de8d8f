#pragma once
// What a QLoRA fine-tune is: PEFT's LoraConfig fields (r, lora_alpha,
// lora_dropout, target_modules, use_rslora) and bitsandbytes' 4-bit
// settings (NF4, block 64, double quantization, compute dtype), with PEFT's
// adapter_config.json as their file form.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/dtype.h"

namespace quanta::llm {

/** PEFT's target_modules value that selects every linear layer but the
 * output projection. */
inline constexpr const char* kAllLinear = "all-linear";

/** LoRA adapters as PEFT's LoraConfig describes them. */
struct LoraSettings {
  int64_t r = 8;
  double lora_alpha = 8;
  double lora_dropout = 0;
  /** Module-name suffixes ("q_proj" matches "model.layers.0.self_attn.q_proj"),
   * or the one entry "all-linear". */
  std::vector<std::string> target_modules = {kAllLinear};
  /** alpha / sqrt(r) instead of alpha / r. */
  bool use_rslora = false;
  /** The base model's folder, as the user named it (recorded, checked on load). */
  std::string base_model_name_or_path;
};

/** How the base is quantized (bitsandbytes' BitsAndBytesConfig, 4-bit NF4):
 * every linear layer but lm_head, as transformers' load_in_4bit does. */
struct BaseQuantization {
  int64_t blocksize = 64;
  bool double_quant = true;
  /** The dtype the weights are dequantized to (bnb_4bit_compute_dtype):
   * bf16 or f32 (f16 too). */
  DType compute_dtype = DType::bf16;
};

/** Splits "q_proj,v_proj" (or "all-linear") into target_modules entries;
 * throws std::invalid_argument for an empty entry. */
std::vector<std::string> parse_target_modules(const std::string& text);

/** Throws std::invalid_argument naming the first bad field. */
void check_lora_settings(const LoraSettings& lora);

/** adapter_config.json as PEFT writes it (peft_type LORA, task_type
 * CAUSAL_LM, bias none, ...), with `quantization` recording how the base
 * was quantized under the key "quanta_base_quantization" (PEFT ignores keys
 * it does not know). */
nlohmann::json adapter_config_json(const LoraSettings& lora, const BaseQuantization& quantization);

/** Reads an adapter_config.json object (PEFT's, or ours). Throws
 * std::runtime_error naming `source` and the field for anything that is not
 * a LoRA adapter of a causal LM this library applies (another peft_type,
 * bias other than none, fan_in_fan_out, DoRA, layers_to_transform, ...). */
LoraSettings read_adapter_config(const nlohmann::json& config, const std::string& source);

/** The base quantization recorded in an adapter_config.json; for a folder
 * PEFT wrote (no record), bitsandbytes' QLoRA settings (NF4, block 64,
 * double quant) computing in `model_dtype`, as Linear4bit does when the
 * activations are f32 or bf16. */
BaseQuantization read_base_quantization(const nlohmann::json& config, const std::string& source,
                                        DType model_dtype);

}  // namespace quanta::llm
