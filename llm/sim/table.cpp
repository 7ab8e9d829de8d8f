// sim's language-model table: the CPU's entries, each queued on the current
// sim device's stream, as the engine's and the quantizers' sim tables are.
#include "llm/kernels/table.h"

#include "engine/sim/queued.h"

namespace quanta::llm::llm_sim {

const LlmKernelTable& table() {
#define QUANTA_SIM_LLM_KERNEL(entry) \
  .entry = sim::Queued<&llm_cpu::table, &LlmKernelTable::entry>::call,
  static const LlmKernelTable t{.device_name = "sim",
                                QUANTA_LLM_KERNEL_ENTRIES(QUANTA_SIM_LLM_KERNEL)};
#undef QUANTA_SIM_LLM_KERNEL
  return t;
}

}  // namespace quanta::llm::llm_sim
