#pragma once
// transformers' 4-bit checkpoints: a model folder whose linear layers are
// bitsandbytes NF4 states (the tensors Linear4bit serializes) and whose
// config.json carries the quantization_config that load_in_4bit wrote, so
// that AutoModelForCausalLM.from_pretrained loads it without quantizing.
#include <string>

#include "llm/model/causal_lm.h"
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
 * part of it (save_peft_adapters writes them). Throws std::invalid_argument
 * for a model without NF4 layers. */
void save_bnb_folder(CausalLM& model, const BaseQuantization& quantization, const std::string& dir);

}  // namespace quanta::llm
