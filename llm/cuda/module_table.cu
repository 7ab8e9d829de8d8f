// The CUDA language-model table, exported by the CUDA module as
// quanta_llm_cuda_table_v1 (libquanta finds it by name: llm/cuda/table.cpp).
#include "llm/cuda/kernels.h"

extern "C" __attribute__((visibility("default"))) const quanta::llm::LlmKernelTable*
quanta_llm_cuda_table_v1() {
  using namespace quanta::llm::llm_cuda;
  static const quanta::llm::LlmKernelTable t{
      .device_name = "cuda",
      .rms_norm = rms_norm,
      .rms_norm_grad = rms_norm_grad,
      .rope = rope,
      .attention = attention,
      .attention_grad = attention_grad,
  };
  return &t;
}
