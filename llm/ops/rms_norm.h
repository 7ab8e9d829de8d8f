#pragma once
// RMSNorm as decoder language models apply it, fused forward and backward.
#include "engine/tensor.h"

namespace quanta::llm {

/** weight * (x / sqrt(mean(x^2) + eps)) over the last dim of x [..., n], as
 * transformers' LlamaRMSNorm: the mean and the scale in f32 whatever x's
 * dtype (f64 for f64 x), the normalised value rounded to x's dtype before
 * the weight multiplies it. With `one_plus_weight`, GemmaRMSNorm's: (1 +
 * weight) * x / sqrt(...) all in f32 (f64), rounded once (Gemma's norms
 * store the scale's offset from 1). x and weight [n] share one of f32, f64,
 * bf16, f16 and a device. Differentiable in x and weight. */
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6,
                bool one_plus_weight = false);

}  // namespace quanta::llm
