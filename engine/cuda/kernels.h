#pragma once
// The CUDA table's entries, one family per file (elementwise_kernels.cu,
// gemm.cu, reduce_kernels.cu, index_kernels.cu, conv_kernels.cu,
// pool_kernels.cu, distance_kernels.cu, random_kernels.cu,
// optim_kernels.cu), each a function named and typed as its entry in
// KernelTable (engine/kernels/table.h); table.cu puts them in the table.
// Like engine/cpu/kernels.h for the CPU.
#include "engine/kernels/table.h"

namespace quanta::cuda {

QUANTA_KERNEL_ENTRIES(QUANTA_DECLARE_KERNEL)

}  // namespace quanta::cuda
