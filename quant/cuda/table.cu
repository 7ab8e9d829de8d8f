// The CUDA quantizer table, exported by the CUDA module as
// quanta_quant_cuda_table_v1 (libquanta finds it by name:
// quant/cuda/unavailable.cpp). Every entry the function of its name
// (kernels.h).
#include "quant/cuda/kernels.h"

extern "C" __attribute__((visibility("default"))) const quanta::quant::QuantKernelTable*
quanta_quant_cuda_table_v1() {
  using namespace quanta::quant::quant_cuda;
  static const quanta::quant::QuantKernelTable t{.device_name = "cuda",
                                                 QUANTA_QUANT_KERNEL_ENTRIES(QUANTA_FILL_KERNEL)};
  return &t;
}
