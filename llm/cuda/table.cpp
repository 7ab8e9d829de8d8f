// llm_cuda::table() in libquanta: the CUDA module's language-model table
// (quanta_llm_cuda_table_v1, found by name as the quantizers' table is), or,
// in a build without CUDA or where the module or the symbol cannot be had, a
// table whose entries throw naming the op and the reason. Links no CUDA
// library.
#include "llm/kernels/table.h"

#include <stdexcept>
#include <string>

#include "engine/cuda/module.h"

namespace quanta::llm::llm_cuda {
namespace {

struct Chosen {
  const LlmKernelTable* table = nullptr;
  std::string reason;  // why `table` is the unavailable one
};

const Chosen& chosen() {
  static const Chosen c = []() -> Chosen {
    if (!cuda::module()) return {&unavailable_table(), cuda::unavailable_reason()};
    try {
      using Entry = const LlmKernelTable* (*)();
      auto entry =
          reinterpret_cast<Entry>(cuda::module_symbol("llm_kernels", "quanta_llm_cuda_table_v1"));
      return {entry(), ""};
    } catch (const std::exception& e) {
      return {&unavailable_table(), e.what()};
    }
  }();
  return c;
}

[[noreturn]] void unavailable(const char* op) {
  const std::string& why = chosen().reason;
  throw std::runtime_error(
      std::string("[") + op + "] has no CUDA kernel here: " +
      (why.empty() ? "the CUDA module's language-model table is not in use" : why) +
      "; move the tensors to cpu");
}

}  // namespace

const LlmKernelTable& unavailable_table() {
  static const LlmKernelTable t{
      .device_name = "cuda",
      .rms_norm = [](DType, const void*, const void*, int64_t, int64_t, double, void*,
                     void*) { unavailable("rms_norm"); },
      .rms_norm_grad = [](DType, const void*, const void*, const void*, const void*, int64_t,
                          int64_t, void*, void*) { unavailable("rms_norm backward"); },
      .rope = [](DType, bool, const void*, const void*, const void*, int64_t, int64_t, int64_t,
                 void*) { unavailable("rope"); },
      .attention = [](const AttentionArgs&) { unavailable("scaled_dot_product_attention"); },
      .attention_grad = [](const AttentionArgs&, const void*, void*, void*, void*,
                           void*) { unavailable("scaled_dot_product_attention backward"); },
  };
  return t;
}

const LlmKernelTable& table() { return *chosen().table; }

}  // namespace quanta::llm::llm_cuda
