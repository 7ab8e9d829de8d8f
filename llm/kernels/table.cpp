// llm_kernels(): the one place a device picks its language-model table.
#include "llm/kernels/table.h"

#include "engine/cuda/module.h"
#include "engine/kernels/table.h"
#include "engine/profile/timed_table.h"
#include "engine/sim/sim_stream.h"
#include "engine/tensor.h"

namespace quanta::llm {

namespace {

const LlmKernelTable& table_of(Device device) {
  if (device.is_cpu()) return llm_cpu::table();
  if (device.is_sim()) {
    sim::set_current_index(device.index);
    return llm_sim::table();
  }
  // Entries take raw pointers, not devices: the launch goes to the current
  // one, as the engine's kernels() has it.
  if (const cuda::Module* m = cuda::module()) m->set_device(device.index);
  return llm_cuda::table();
}

}  // namespace

const LlmKernelTable& llm_kernels(Device device) {
  return profile::kernel_lookup(
      table_of(device), device, "llm",
      [](auto d, LlmKernelTable& t, const LlmKernelTable& s, const char* seam) {
        QUANTA_LLM_KERNEL_ENTRIES(QUANTA_TIME_ENTRY)
      });
}

const LlmKernelTable& llm_kernels_for(const char* op, std::initializer_list<const Tensor*> ts) {
  return llm_kernels(common_device(op, ts));
}

}  // namespace quanta::llm
