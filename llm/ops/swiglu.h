#pragma once
// SwiGLU, the gated activation of Llama-family MLPs: silu(gate) * up.
#include "engine/tensor.h"

namespace quanta::llm {

/** silu(gate) * up, elementwise, as transformers' LlamaMLP forms
 * act_fn(gate_proj(x)) * up_proj(x): the same values and gradients, bit for
 * bit, as mul(silu(gate), up). The graph keeps gate and up only and forms
 * silu(gate) again in the backward, where the two ops also kept silu(gate):
 * one [tokens, intermediate] tensor less per layer. gate and up share a
 * shape, a floating dtype and a device. Differentiable in both. */
Tensor swiglu(const Tensor& gate, const Tensor& up);

}  // namespace quanta::llm
