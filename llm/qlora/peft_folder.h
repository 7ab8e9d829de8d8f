#pragma once
// PEFT adapter folders: adapter_config.json and adapter_model.safetensors
// with PEFT's tensor names (base_model.model.<module>.lora_A.weight), as
// PeftModel.save_pretrained writes them and PeftModel.from_pretrained
// reads them.
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>

#include "engine/io/safetensors.h"
#include "engine/nn/module.h"
#include "llm/model/causal_lm.h"
#include "llm/qlora/lora_config.h"
#include "llm/qlora/qlora_model.h"

namespace quanta::llm {

inline constexpr const char* kAdapterConfigFile = "adapter_config.json";
inline constexpr const char* kAdapterWeightsFile = "adapter_model.safetensors";

/** PEFT's saved name of adapter `which` ("lora_A" or "lora_B") of the layer
 * called `module`: "base_model.model." + module + "." + which + ".weight". */
std::string peft_tensor_name(const std::string& module, const std::string& which);

/** What a converted model (apply_qlora with `lora`) trains, under PEFT's
 * saved names, in model order: each adapted layer's tensors
 * (LoRALinear::adapter_tensors: "base_model.model.<layer>.lora_A.weight",
 * ...), the biases lora.bias trains (trained_biases:
 * "base_model.model.<layer>.base_layer.bias"), the trainable tokens
 * ("base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"),
 * then the parameters of the
 * modules lora.modules_to_save names ("base_model.model.lm_head.weight").
 * The live parameters, whose gradients are the training's. */
std::vector<std::pair<std::string, Tensor>> peft_trained_parameters(Module& model,
                                                                    const LoraSettings& lora);

/** peft_trained_parameters, detached (not copied): what
 * adapter_model.safetensors holds. */
io::TensorMap peft_adapter_tensors(Module& model, const LoraSettings& lora);

/** Writes `dir` (created if needed): adapter_config.json (`lora`,
 * recording `quantization`) and adapter_model.safetensors, each atomically.
 * Adapters that started from PiSSA, OLoRA or CorDA (LoRALinear::initial_lora_A)
 * are written as PEFT's save_pretrained with
 * path_initial_model_for_weight_conversion writes them: a LoRA of rank 2r
 * over the original weight ([B | -B0], [A; A0]; converted_to_lora's
 * config), which PEFT and apply_peft_adapters load over the unchanged base.
 * Over a quantized base that is NF4(W) + the change where training had
 * NF4(W_res): PEFT's own caveat; merging (merge_qlora) keeps the trained
 * model exactly. */
void save_peft_adapters(Module& model, const LoraSettings& lora,
                        const BaseQuantization& quantization, const std::string& dir);

/** An adapter folder's settings. */
struct AdapterFolderConfig {
  LoraSettings lora;
  BaseQuantization quantization;
};

/** Reads dir/adapter_config.json (read_adapter_config's checks; the
 * quantization as read_base_quantization reads it for a model of
 * `model_dtype`); errors name the file. */
AdapterFolderConfig read_adapter_folder_config(const std::string& dir,
                                               DType model_dtype = DType::f32);

/** Copies dir/adapter_model.safetensors into the adapters (and the biases
 * and modules trained whole) of a model that apply_qlora converted with the folder's
 * settings (converted to each tensor's dtype). Throws std::runtime_error naming the file and
 * listing every missing, unexpected and mis-shaped tensor; the model is unchanged then. */
void load_peft_adapter_tensors(Module& model, const std::string& dir);

/** An adapter folder whose base_model_name_or_path names another base than
 * the one given (apply_peft_adapters). */
struct AdapterBaseMismatch : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/** What changes when a folder's adapters are trained on (quanta finetune
 * --adapters) rather than only run: PEFT's from_pretrained(is_trainable=True)
 * with these in the config it passes. */
struct AdapterTraining {
  /** The seed of the adapters' dropout streams (QLoRAOptions::seed). */
  uint64_t seed = 0;
  /** The adapters' dropout instead of the folder's lora_dropout. */
  std::optional<double> lora_dropout{};
  /** The base's compute dtype instead of the folder's bnb_4bit_compute_dtype
   * (the stored bytes and scales do not depend on it). */
  std::optional<DType> compute_dtype{};
  /** QLoRAOptions::on_layer_converted of the conversion: a loader that
   * shards each layer as it is made (the folder's tensors are adapter
   * parameters, copied in after, never the sharded bases). */
  std::function<void(const std::string& layer)> on_layer_converted{};
};

/** Applies the adapter folder `adapter_dir` to the model loaded from
 * `base_dir`: apply_qlora with the folder's settings (and `training`'s),
 * then its tensors. A folder whose base_model_name_or_path ends in another name than
 * `base_dir` is refused, naming both (an adapter made for another base:
 * AdapterBaseMismatch); an empty `base_dir` skips that check. Any other
 * misfit (a setting the model refuses, a tensor missing, unexpected or of
 * another shape) throws std::runtime_error naming the file, found before the
 * model is converted: the model is unchanged then. */
QLoRAReport apply_peft_adapters(CausalLM& model, const std::string& adapter_dir,
                                const std::string& base_dir, const AdapterTraining& training = {});

}  // namespace quanta::llm
