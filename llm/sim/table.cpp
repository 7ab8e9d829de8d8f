// sim's language-model table: the CPU's entries, each queued on the current
// sim device's stream, as the engine's and the quantizers' sim tables are.
#include "llm/kernels/table.h"

#include "engine/sim/queued.h"

namespace quanta::llm::llm_sim {

const LlmKernelTable& table() {
  using llm_cpu::table;
  using sim::Queued;
  using T = LlmKernelTable;
  static const LlmKernelTable t{
      .device_name = "sim",
      .rms_norm = Queued<&table, &T::rms_norm>::call,
      .rms_norm_grad = Queued<&table, &T::rms_norm_grad>::call,
      .rope = Queued<&table, &T::rope>::call,
      .attention = Queued<&table, &T::attention>::call,
      .attention_grad = Queued<&table, &T::attention_grad>::call,
  };
  return t;
}

}  // namespace quanta::llm::llm_sim
