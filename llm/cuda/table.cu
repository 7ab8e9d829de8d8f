// The CUDA language-model table, exported by the CUDA module as
// quanta_llm_cuda_table_v1 (libquanta finds it by name:
// llm/cuda/unavailable.cpp). Every entry the function of its name.
#include "llm/cuda/kernels.h"

extern "C" __attribute__((visibility("default"))) const quanta::llm::LlmKernelTable*
quanta_llm_cuda_table_v1() {
  using namespace quanta::llm::llm_cuda;
  static const quanta::llm::LlmKernelTable t{.device_name = "cuda",
                                             QUANTA_LLM_KERNEL_ENTRIES(QUANTA_FILL_KERNEL)};
  return &t;
}
