// The CPU quantizer table: every entry the function of its name (kernels.h).
#include "quant/cpu/kernels.h"

namespace quanta::quant::quant_cpu {

const QuantKernelTable& table() {
  static const QuantKernelTable t{.device_name = "cpu",
                                  QUANTA_QUANT_KERNEL_ENTRIES(QUANTA_FILL_KERNEL)};
  return t;
}

}  // namespace quanta::quant::quant_cpu
