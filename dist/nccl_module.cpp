// make_nccl_backend: NCCL lives in libquanta_cuda with the rest of CUDA, so
// libquanta never links it; the backend is made through the module's entry.
#include <memory>

#include "dist/nccl_backend.h"
#include "engine/cuda/module.h"

namespace quanta::dist::detail {

std::unique_ptr<Backend> make_nccl_backend(Store& store, int rank, int size, int device,
                                           Millis timeout) {
  using Make = Backend* (*)(Store&, int, int, int, Millis);
  auto make = reinterpret_cast<Make>(cuda::module_symbol("dist::nccl", "quanta_nccl_backend_v1"));
  return std::unique_ptr<Backend>(make(store, rank, size, device, timeout));
}

}  // namespace quanta::dist::detail
