#pragma once
// Until the CUDA kernels land (issue 9) ops run on the CPU only; this names
// the op and the device when one is handed a CUDA tensor.
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "engine/tensor.h"

namespace quanta::detail {

inline void check_cpu(const char* op, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->defined() && !t->device().is_cpu())
      throw std::runtime_error(std::string("[") + op + "] has no kernel for device " +
                               t->device().str() + " yet; move the tensor to cpu");
}

}  // namespace quanta::detail
