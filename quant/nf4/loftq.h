#pragma once
// LoftQ's start for adapters over an NF4 base (Li et al. 2023, "LoftQ:
// LoRA-Fine-Tuning-Aware Quantization"), as PEFT's replace_lora_weights_loftq
// applies it to a bitsandbytes model: one iteration, the base kept as it was
// quantized. The adapters start as the best rank-r correction of the
// quantization error instead of zero, so the model begins closer to its
// float weights.
#include <utility>
#include <vector>

#include "engine/tensor.h"
#include "quant/nf4/nf4_modules.h"

namespace quanta::quant {

/** What an adapter start did to one layer's quantization error (LoftQ's,
 * and PiSSA's and OLoRA's, which quantize a residual instead): the squared
 * Frobenius norm of W - Q with the base quantized from W, and of
 * W - Q' - scaling B A with the base Q' the start leaves. */
struct QuantizationErrorChange {
  double before = 0, after = 0;
};

/** Sets `layer`'s adapters from `weight` [out, in], the float weight its
 * base was quantized from (the model's dtype; computed in f64 for an f64
 * weight, else f32): with E = weight - Q, Q the base dequantized to the
 * layer's base dtype (what bitsandbytes' dequantize_4bit returns), and
 * E's r largest singular triplets U S Vh, A = sqrt(S / scaling) Vh and
 * B = U sqrt(S / scaling), so that scaling B A is E's nearest rank-r
 * matrix. PEFT's replace_lora_weights_loftq sets A = sqrt(S) Vh and
 * B = U sqrt(S) whatever the scaling: the same when lora_alpha is r (as
 * PEFT's LoftQ examples set it), scaling times the correction otherwise.
 * Singular vectors' signs follow top_singular_triplets. With DoRA the
 * magnitude follows (LoRALinear::set_adapters). Throws
 * std::invalid_argument when `weight`'s shape is not the base's. */
QuantizationErrorChange loftq_init(LoRALinear& layer, const Tensor& weight);

/** loftq_init of several layers, each with its float weight, their SVDs on
 * the CPU's threads at once: the same adapters as one at a time. Holds every
 * layer's error on the host together: give as many layers as there are
 * threads. */
std::vector<QuantizationErrorChange> loftq_init(
    const std::vector<std::pair<LoRALinear*, Tensor>>& layers);

}  // namespace quanta::quant
