#pragma once
// SwiGLU, the gated activation of Llama-family MLPs: silu(gate) * up.
#include "engine/tensor.h"

namespace quanta::llm {

/** silu(gate) * up, elementwise, as transformers' LlamaMLP forms
 * act_fn(gate_proj(x)) * up_proj(x): one fused kernel of the device's
 * language-model table each way (llm/kernels/table.h has the roundings:
 * those of PyTorch's silu, mul and their backward), within rounding of
 * mul(silu(gate), up), which makes eight passes over [tokens,
 * intermediate] in the backward where this makes one. The graph keeps gate
 * and up only (no silu(gate)). gate and up share a shape, a floating dtype
 * and a device. Differentiable in both. */
Tensor swiglu(const Tensor& gate, const Tensor& up);

}  // namespace quanta::llm
