#pragma once
// The CPU table's entries, one family per file (elementwise_kernels.cpp,
// reduce_kernels.cpp, softmax_kernels.cpp, gemm.cpp, index_kernels.cpp,
// conv_kernels.cpp, pool_kernels.cpp, distance_kernels.cpp,
// random_kernels.cpp, dropout_product.cpp, optim_kernels.cpp), each a
// function named and typed as its entry in KernelTable
// (engine/kernels/table.h); table.cpp puts them in the table.
#include "engine/kernels/table.h"

namespace quanta::cpu {

QUANTA_KERNEL_ENTRIES(QUANTA_DECLARE_KERNEL)

}  // namespace quanta::cpu
