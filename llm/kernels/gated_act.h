#pragma once
// The activations of a gated MLP, act(gate) * up, shared by the kernel
// table (llm/kernels/table.h), the per-element math (functors.h) and the op.
#include <cstdint>

namespace quanta::llm {

/** SiLU (SwiGLU: Llama, Mistral, Qwen) or GELU's tanh approximation (GeGLU:
 * Gemma's gelu_pytorch_tanh). */
enum class GatedAct : uint8_t { silu, gelu_tanh };

}  // namespace quanta::llm
