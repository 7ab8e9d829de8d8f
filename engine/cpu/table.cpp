// The CPU kernel table: every entry the function of its name (kernels.h).
#include "engine/cpu/gemm.h"
#include "engine/cpu/kernels.h"

namespace quanta::cpu {

const KernelTable& cpu_kernels() {
  static const KernelTable table{
      .device_name = "cpu", .gemm_16bit = false, QUANTA_KERNEL_ENTRIES(QUANTA_FILL_KERNEL)};
  return table;
}

}  // namespace quanta::cpu
