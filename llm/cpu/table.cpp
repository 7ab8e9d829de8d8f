// The CPU's language-model table: every entry the function of its name.
#include "llm/cpu/kernels.h"

namespace quanta::llm::llm_cpu {

const LlmKernelTable& table() {
  static const LlmKernelTable t{.device_name = "cpu",
                                QUANTA_LLM_KERNEL_ENTRIES(QUANTA_FILL_KERNEL)};
  return t;
}

}  // namespace quanta::llm::llm_cpu
