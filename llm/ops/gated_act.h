#pragma once
// The gated activation of decoder MLPs, act(gate) * up: SwiGLU (Llama,
// Mistral, Qwen) and GeGLU with GELU's tanh approximation (Gemma).
#include "engine/tensor.h"
#include "llm/kernels/gated_act.h"

namespace quanta::llm {

/** act(gate) * up, elementwise, as transformers' MLPs form
 * act_fn(gate_proj(x)) * up_proj(x): one fused kernel of the device's
 * language-model table each way (llm/kernels/table.h has the roundings:
 * those of PyTorch's activation, mul and their backward), within rounding
 * of mul(act(gate), up), which makes eight passes over [tokens,
 * intermediate] in the backward where this makes one. The graph keeps gate
 * and up only (no act(gate)). gate and up share a shape, a floating dtype
 * and a device. Differentiable in both. */
Tensor gated_activation(const Tensor& gate, const Tensor& up, GatedAct act);

/** SwiGLU: gated_activation with SiLU. */
inline Tensor swiglu(const Tensor& gate, const Tensor& up) {
  return gated_activation(gate, up, GatedAct::silu);
}

}  // namespace quanta::llm
