// quant_kernels(): the one place a device picks its quantizer kernel table,
// and the one place a tensor on a device the table lacks is reported.
#include "quant/kernels/table.h"

#include <stdexcept>
#include <string>

#include "engine/cuda/module.h"
#include "engine/kernels/table.h"
#include "engine/profile/timed_table.h"
#include "engine/sim/sim_stream.h"
#include "engine/tensor.h"

namespace quanta::quant {

namespace {

const QuantKernelTable& table_of(Device device) {
  if (device.is_cpu()) return quant_cpu::table();
  if (device.is_sim()) {
    sim::set_current_index(device.index);
    return quant_sim::table();
  }
  // Entries take raw pointers, not devices: the launch goes to the current
  // one, as the engine's kernels() has it.
  if (const cuda::Module* m = cuda::module()) m->set_device(device.index);
  return quant_cuda::table();
}

}  // namespace

const QuantKernelTable& quant_kernels(Device device) {
  return profile::kernel_lookup(
      table_of(device), device, "quant",
      [](auto d, QuantKernelTable& t, const QuantKernelTable& s, const char* seam) {
        QUANTA_QUANT_KERNEL_ENTRIES(QUANTA_TIME_ENTRY)
      });
}

const QuantKernelTable& quant_kernels_for(const char* op, std::initializer_list<const Tensor*> ts) {
  return quant_kernels(common_device(op, ts));
}

}  // namespace quanta::quant
