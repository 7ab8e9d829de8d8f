// The CPU kernel table: every entry the function of its name (kernels.h).
#include "engine/cpu/gemm.h"
#include "engine/cpu/gemm_bf16.h"
#include "engine/cpu/keep_mask.h"
#include "engine/cpu/kernels.h"

namespace quanta::cpu {

const KernelTable& cpu_kernels() {
  // bf16 products where the CPU multiplies bf16 natively (gemm_bf16.h);
  // f16 always widens to f32.
  static const KernelTable table{.device_name = "cpu",
                                 .gemm_bf16 = bf16_gemm_native(),
                                 .gemm_f16 = false,
                                 .half_elementwise = true,
                                 .half_reductions = true,
                                 .dropout_keeps_bits = kDropoutKeepsBits,
                                 QUANTA_KERNEL_ENTRIES(QUANTA_FILL_KERNEL)};
  return table;
}

}  // namespace quanta::cpu
