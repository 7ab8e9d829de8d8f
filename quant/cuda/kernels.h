#pragma once
// The CUDA quantizer table's entries, one family per file (vq_kernels.cu,
// lfq_kernels.cu, nf4_kernels.cu); table.cu puts them in the table the CUDA
// module exports, each a function named and typed as its entry. Contracts: quant/kernels/table.h.
// Pointers are on the current device; everything is queued on its default stream.
#include "quant/kernels/table.h"

namespace quanta::quant::quant_cuda {

QUANTA_QUANT_KERNEL_ENTRIES(QUANTA_DECLARE_QUANT_KERNEL)

}  // namespace quanta::quant::quant_cuda
