// llm_cuda::table() in libquanta: the CUDA module's language-model table
// (quanta_llm_cuda_table_v1, found by name as the quantizers' table is), or,
// in a build without CUDA or where the module or the symbol cannot be had, a
// table whose entries throw naming the op and the reason. Links no CUDA
// library.
#include "engine/cuda/module_table.h"
#include "llm/kernels/table.h"

namespace quanta::llm::llm_cuda {
namespace {

const cuda::ModuleTable<LlmKernelTable>& chosen() {
  static const cuda::ModuleTable<LlmKernelTable> c("llm_kernels", "quanta_llm_cuda_table_v1",
                                                   unavailable_table());
  return c;
}

[[noreturn]] void unavailable(const char* op) {
  cuda::no_cuda_kernel(op, chosen().reason, "language-model");
}

}  // namespace

// One line an entry: each lambda takes the entry's arguments as they come.
const LlmKernelTable& unavailable_table() {
  static const LlmKernelTable t{
      .device_name = "cuda",
      .rms_norm = [](auto...) { unavailable("rms_norm"); },
      .rms_norm_grad = [](auto...) { unavailable("rms_norm backward"); },
      .rope = [](auto...) { unavailable("rope"); },
      .gated_act = [](auto...) { unavailable("gated_act"); },
      .gated_act_grad = [](auto...) { unavailable("gated_act backward"); },
      .attention = [](auto...) { unavailable("scaled_dot_product_attention"); },
      .attention_grad = [](auto...) { unavailable("scaled_dot_product_attention backward"); },
      .lm_loss_rows = [](auto...) { unavailable("chunked_causal_lm_loss"); },
  };
  return t;
}

const LlmKernelTable& table() { return *chosen().table; }

}  // namespace quanta::llm::llm_cuda
