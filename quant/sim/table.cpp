// sim's quantizer table: the CPU's entries, each queued on the current sim
// device's stream, as the engine's sim table queues its kernels.
#include "quant/kernels/table.h"

#include "engine/sim/queued.h"

namespace quanta::quant::quant_sim {

const QuantKernelTable& table() {
#define QUANTA_SIM_QUANT_KERNEL(entry) \
  .entry = sim::Queued<&quant_cpu::table, &QuantKernelTable::entry>::call,
  static const QuantKernelTable t{.device_name = "sim",
                                  QUANTA_QUANT_KERNEL_ENTRIES(QUANTA_SIM_QUANT_KERNEL)};
#undef QUANTA_SIM_QUANT_KERNEL
  return t;
}

}  // namespace quanta::quant::quant_sim
