#pragma once
// NCCL for CUDA tensors: one communicator per group and device, its unique id
// passed through the store, created non-blocking so init has a deadline too.
// NCCL kernels wait for their peers forever, so every call is watched: the
// caller polls the completion event and ncclCommGetAsyncError against the
// deadline and aborts the communicator (ncclCommAbort) on error or timeout.
// Internal to dist; only built with CUDA.
#include <cstddef>
#include <memory>
#include <string>

#include "dist/process_group.h"
#include "dist/store.h"
#include "engine/dtype.h"

namespace quanta::dist::detail {

class NcclBackend {
 public:
  /** Rendezvous through `store` on CUDA device `device`; throws DistError
   * naming the ranks when two share a GPU or init does not finish in time. */
  NcclBackend(Store& store, int rank, int size, int device, Millis timeout);
  ~NcclBackend();
  NcclBackend(const NcclBackend&) = delete;
  NcclBackend& operator=(const NcclBackend&) = delete;

  void all_reduce(void* data, std::size_t n, DType dtype, ReduceOp op, Millis timeout);
  void broadcast(void* data, std::size_t bytes, int root, Millis timeout);
  void all_gather(const void* in, void* out, std::size_t bytes_per_rank, Millis timeout);
  void reduce_scatter(const void* in, void* out, std::size_t n_out, DType dtype, ReduceOp op,
                      Millis timeout);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace quanta::dist::detail
