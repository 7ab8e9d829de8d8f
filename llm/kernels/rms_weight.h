#pragma once
// How an RMSNorm applies its weight, as each model family's class does it,
// shared by the kernel table (llm/kernels/table.h), the per-element math
// (functors.h) and the op.
#include <cstdint>

namespace quanta::llm {

/** Llama's (LlamaRMSNorm, also Mistral, Qwen, Phi-3): the normalised value
 * rounded to the dtype, then times the weight, rounded again. Gemma's
 * (GemmaRMSNorm): (1 + weight) times the normalised value in the
 * accumulation dtype, rounded once (the norms store the offset from 1).
 * OLMo 2's (Olmo2RMSNorm): the weight times the normalised value in the
 * accumulation dtype, rounded once. */
enum class RmsWeight : uint8_t { rounded_first, one_plus, in_accumulation };

}  // namespace quanta::llm
