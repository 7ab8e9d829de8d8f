// The CUDA kernel table: every entry the function of its name, one family
// per file (elementwise_kernels.cu, gemm.cu, reduce_kernels.cu, ...; the
// declarations in kernels.h). Device code is thin: grid-stride walks calling
// the shared functors, CUB's reductions, cuBLAS for GEMM.
#include "engine/cuda/kernels.h"

namespace quanta::cuda {

const KernelTable& cuda_kernels() {
  static const KernelTable table{.device_name = "cuda",
                                 .gemm_bf16 = true,
                                 .gemm_f16 = true,
                                 .half_elementwise = true,
                                 .half_reductions = true,
                                 .dropout_keeps_bits = false,
                                 QUANTA_KERNEL_ENTRIES(QUANTA_FILL_KERNEL)};
  return table;
}

}  // namespace quanta::cuda
