// quant_kernels(): the one place a device picks its quantizer kernel table,
// and the one place a tensor on a device the table lacks is reported.
#include "quant/kernels/table.h"

#include <stdexcept>
#include <string>

#include "engine/kernels/table.h"
#include "engine/tensor.h"

namespace quanta::quant {

const QuantKernelTable& quant_kernels(Device device) {
  if (!device.is_cuda()) return quant_cpu::table();
  // Today every CUDA entry throws naming its op. When the CUDA kernels land
  // (issue 18), make the device current here first, as kernels() does:
  // entries take raw pointers, not devices.
  return quant_cuda::table();
}

const QuantKernelTable& quant_kernels_for(const char* op, std::initializer_list<const Tensor*> ts) {
  return quant_kernels(common_device(op, ts));
}

}  // namespace quanta::quant
