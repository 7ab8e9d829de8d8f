// kernels(): the one place a device picks its kernel table, and the one place
// a tensor on a device the table lacks is reported.
#include "engine/kernels/table.h"

#include <stdexcept>
#include <string>

#include "engine/cuda/module.h"
#include "engine/profile/timed_table.h"
#include "engine/sim/sim_stream.h"
#include "engine/tensor.h"

namespace quanta {

// A profile's rows of the conv entry, one per kind ("engine.conv:conv2d"):
// found by the profiled entries' lookup of op_name (engine/profile/timed_table.h).
static const char* op_name(ConvKind kind) { return conv_op_name(kind); }

namespace {

const KernelTable& table_of(Device device) {
  // Entries take raw pointers, not devices: the launch goes to the current one.
  if (device.is_cpu()) return cpu::cpu_kernels();
  if (device.is_sim()) {
    sim::set_current_index(device.index);
    return sim::sim_kernels();
  }
  const cuda::Module* m = cuda::module();
  if (!m) return cuda::unavailable_kernels();
  m->set_device(device.index);
  return m->kernels();
}

}  // namespace

const KernelTable& kernels(Device device) {
  return profile::kernel_lookup(table_of(device), device, "engine",
                                [](auto d, KernelTable& t, const KernelTable& s, const char* seam) {
                                  QUANTA_KERNEL_ENTRIES(QUANTA_TIME_ENTRY)
                                });
}

Device common_device(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor* first = nullptr;
  for (const Tensor* t : ts) {
    if (!t->defined()) continue;
    if (!first) {
      first = t;
    } else if (t->device() != first->device()) {
      throw std::invalid_argument(std::string("[") + op +
                                  "] operands are on different devices: " + first->device().str() +
                                  " and " + t->device().str() + "; move them to one device first");
    }
  }
  return first ? first->device() : Device::cpu();
}

const KernelTable& kernels_for(const char* op, std::initializer_list<const Tensor*> ts) {
  return kernels(common_device(op, ts));
}

Operand operand_of(const Tensor& t) { return {t.raw_data(), t.dtype(), t.strides().data()}; }

#define QUANTA_NAME_ROW(name, F) #name,
const char* op_name(UnaryOp op) {
  static constexpr const char* names[] = {QUANTA_UNARY_OPS(QUANTA_NAME_ROW)};
  return names[static_cast<int>(op)];
}
const char* op_name(BinaryOp op) {
  static constexpr const char* names[] = {QUANTA_BINARY_OPS(QUANTA_NAME_ROW)};
  return names[static_cast<int>(op)];
}
const char* op_name(UpdateOp op) {
  static constexpr const char* names[] = {QUANTA_UPDATE_OPS(QUANTA_NAME_ROW)};
  return names[static_cast<int>(op)];
}
#undef QUANTA_NAME_ROW

}  // namespace quanta
