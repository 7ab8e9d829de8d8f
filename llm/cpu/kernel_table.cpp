// The CPU's language-model table: one line per entry.
#include "llm/cpu/kernels.h"

namespace quanta::llm::llm_cpu {

const LlmKernelTable& table() {
  static const LlmKernelTable t{
      .device_name = "cpu",
      .rms_norm = rms_norm,
      .rms_norm_grad = rms_norm_grad,
      .rope = rope,
      .attention = attention,
      .attention_grad = attention_grad,
  };
  return t;
}

}  // namespace quanta::llm::llm_cpu
