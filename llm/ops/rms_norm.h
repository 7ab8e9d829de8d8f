#pragma once
// RMSNorm as decoder language models apply it, fused forward and backward.
#include "engine/tensor.h"
#include "llm/kernels/rms_weight.h"

namespace quanta::llm {

/** weight * (x / sqrt(mean(x^2) + eps)) over the last dim of x [..., n], the
 * mean and the scale in f32 whatever x's dtype (f64 for f64 x), the weight
 * applied as `how` says: transformers' LlamaRMSNorm rounds the normalised
 * value to x's dtype before the weight multiplies it; GemmaRMSNorm's (1 +
 * weight) and Olmo2RMSNorm's weight multiply it in f32 (f64), rounded once.
 * x and weight [n] share one of f32, f64, bf16, f16 and a device.
 * Differentiable in x and weight. */
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6,
                RmsWeight how = RmsWeight::rounded_first);

}  // namespace quanta::llm
