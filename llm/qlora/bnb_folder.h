#pragma once
// transformers' 4-bit checkpoints: a model folder whose linear layers are
// bitsandbytes NF4 states (the tensors Linear4bit serializes) and whose
// config.json carries the quantization_config that load_in_4bit wrote, so
// that AutoModelForCausalLM.from_pretrained loads it without quantizing.
#include <memory>
#include <optional>
#include <string>

#include "engine/device.h"
#include "llm/model/causal_lm.h"
#include "llm/model/model_folder.h"
#include "llm/qlora/lora_config.h"

namespace quanta::llm {

/** Writes the NF4 base of a model apply_qlora converted to `dir` (created if
 * needed) as transformers' save_pretrained writes a load_in_4bit model:
 * model.safetensors with each quantized layer's bitsandbytes state under the
 * layer's name (<layer>.weight, .weight.absmax, .weight.quant_map, the
 * nested tensors, .weight.quant_state.bitsandbytes__nf4, <layer>.bias) and
 * every other weight in the model's dtype; config.json with
 * quantization_config (quant_method bitsandbytes, nf4, `quantization`'s
 * double quant and compute dtype, quant_storage uint8). Adapters are not
 * part of it (save_peft_adapters writes them). An image-text model's folder
 * needs its vision tower and projector, `beside` (read_non_decoder_weights
 * of the folder it came from), written as they are, and its
 * quantization_config's llm_int8_skip_modules names them (with lm_head), as
 * transformers writes a folder loaded with those skipped. Throws
 * std::invalid_argument for a model without NF4 layers, or an image-text
 * model without `beside`. Sharded as `options` says (write_model_weights). */
void save_bnb_folder(CausalLM& model, const BaseQuantization& quantization, const std::string& dir,
                     const StateDict& beside = {}, const SaveOptions& options = {});

/** The quantization a model folder's config.json records: set for a
 * bitsandbytes NF4 folder (quant_method bitsandbytes, load_in_4bit,
 * bnb_4bit_quant_type nf4; compute dtype bnb_4bit_compute_dtype, float32
 * when absent, as transformers defaults), empty for a float folder. Another
 * quantization (8-bit, fp4, GPTQ, ...) throws std::runtime_error naming it. */
std::optional<BaseQuantization> folder_quantization(const std::string& dir);

/** The model of a 4-bit folder (save_bnb_folder's, or transformers'), its
 * linear layers NF4 bases holding the folder's bitsandbytes states bit for
 * bit (no float weight is built for them), dequantizing to
 * `compute_dtype` (the folder's when unset); every parameter frozen. Pass it
 * to apply_qlora for adapters. Throws naming the folder and every missing or
 * mis-shaped state. */
std::shared_ptr<CausalLM> load_bnb_folder(const std::string& dir, Device device = Device::cpu(),
                                          std::optional<DType> compute_dtype = std::nullopt);

/** The model of folder `dir`: load_bnb_folder for a 4-bit folder,
 * load_causal_lm with `options` for a float one (compute_dtype unused; a
 * 4-bit folder holds no float layer weights to defer). */
std::shared_ptr<CausalLM> load_base_model(const std::string& dir, Device device = Device::cpu(),
                                          std::optional<DType> compute_dtype = std::nullopt,
                                          const LoadOptions& options = {});

}  // namespace quanta::llm
