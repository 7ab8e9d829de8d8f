// quant_kernels(): the one place a device picks its quantizer kernel table,
// and the one place a tensor on a device the table lacks is reported.
#include "quant/kernels/table.h"

#include <stdexcept>
#include <string>

#include "engine/tensor.h"

namespace quanta::quant {

const QuantKernelTable& quant_kernels(Device device) {
  if (!device.is_cuda()) return quant_cpu::table();
  // Today every CUDA entry throws naming its op. When the CUDA kernels land
  // (issue 18), make the device current here first, as kernels() does:
  // entries take raw pointers, not devices.
  return quant_cuda::table();
}

const QuantKernelTable& quant_kernels_for(const char* op,
                                          std::initializer_list<const Tensor*> ts) {
  const Tensor* first = nullptr;
  for (const Tensor* t : ts) {
    if (!t->defined()) continue;
    if (!first) {
      first = t;
    } else if (t->device() != first->device()) {
      throw std::invalid_argument(std::string("[") + op + "] operands are on different devices: " +
                                  first->device().str() + " and " + t->device().str() +
                                  "; move them to one device first");
    }
  }
  return quant_kernels(first ? first->device() : Device::cpu());
}

}  // namespace quanta::quant
