// make_nccl_backend: NCCL lives in libquanta_cuda with the rest of CUDA, so
// libquanta never links it; the backend is made through the module's entry.
// And the per-thread ready event the backend's collectives wait for, kept
// here in libquanta, which DataParallel and the module both link.
#include <memory>

#include "dist/backend/nccl_backend.h"
#include "engine/cuda/module.h"

namespace quanta::dist::detail {

namespace {
thread_local void* tls_ready_event = nullptr;
}  // namespace

void* ready_event() { return tls_ready_event; }

ReadyAfter::ReadyAfter(void* event) : previous_(tls_ready_event) { tls_ready_event = event; }

ReadyAfter::~ReadyAfter() { tls_ready_event = previous_; }

std::unique_ptr<Backend> make_nccl_backend(Store& store, int rank, int size, int device,
                                           Millis timeout) {
  using Make = Backend* (*)(Store&, int, int, int, Millis);
  auto make = reinterpret_cast<Make>(cuda::module_symbol("dist::nccl", "quanta_nccl_backend_v1"));
  return std::unique_ptr<Backend>(make(store, rank, size, device, timeout));
}

}  // namespace quanta::dist::detail
