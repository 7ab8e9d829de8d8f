#pragma once
// NCCL for CUDA tensors: one communicator per group and device, its unique id
// passed through the store, created non-blocking so init has a deadline too.
// NCCL kernels wait for their peers forever, so every call is watched: the
// caller polls the completion event and ncclCommGetAsyncError against the
// deadline and aborts the communicator (ncclCommAbort) on error or timeout.
// Buffers are device memory (all_reduce_checked's check region: host
// memory); tags are not used (NCCL orders calls by issue). Every call makes
// the backend's device current and restores the caller's.
// Internal to dist. The class is compiled into libquanta_cuda (the CUDA
// module, engine/cuda/module.h); libquanta makes one through
// make_nccl_backend, which throws naming why when there is no CUDA backend.
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "dist/backend/backend.h"
#include "dist/process_group.h"
#include "dist/store/store.h"
#include "engine/dtype.h"

namespace quanta::dist::detail {

/** The device work the collectives this thread issues next must wait for:
 * while a ReadyAfter lives on this thread, the event it names, recorded when
 * the data became ready (DataParallel records one when a bucket fills), of
 * the collective's device type: a CUDA event (cudaEvent_t) for NCCL, a
 * sim::Event (engine/sim/sim_stream.h) for Gloo on a sim device; otherwise
 * null, and a collective waits for everything queued on the device when it
 * starts. */
void* ready_event();

/** Sets ready_event() on this thread for its lifetime (restoring the one
 * before it). The event must outlive the scope. */
class ReadyAfter {
 public:
  explicit ReadyAfter(void* event);
  ~ReadyAfter();
  ReadyAfter(const ReadyAfter&) = delete;
  ReadyAfter& operator=(const ReadyAfter&) = delete;

 private:
  void* previous_;
};

/** An NcclBackend made inside the CUDA module (the constructor's rules and
 * errors below); throws std::runtime_error "[dist::nccl] ..." when quanta was
 * built without CUDA or the module cannot be loaded. */
std::unique_ptr<Backend> make_nccl_backend(Store& store, int rank, int size, int device,
                                           Millis timeout);

class NcclBackend final : public Backend {
 public:
  /** Rendezvous through `store` on CUDA device `device`; throws DistError
   * naming the ranks when two share a GPU or init does not finish in time. */
  NcclBackend(Store& store, int rank, int size, int device, Millis timeout);
  ~NcclBackend() override;
  NcclBackend(const NcclBackend&) = delete;
  NcclBackend& operator=(const NcclBackend&) = delete;

  const char* name() const override { return "nccl"; }
  /** ncclAllReduce; avg is ncclAvg. */
  void all_reduce(void* data, std::size_t n, DType dtype, ReduceOp op, uint32_t tag,
                  Millis timeout) override;
  /** The data and the host check region in one NCCL group, the region
   * copied through pinned memory on the backend's stream. */
  void all_reduce_checked(void* data, std::size_t n, void* check, std::size_t check_n, DType dtype,
                          ReduceOp op, uint32_t tag, Millis timeout) override;
  void broadcast(void* data, std::size_t bytes, int root, uint32_t tag, Millis timeout) override;
  void all_gather(const void* in, void* out, std::size_t bytes_per_rank, uint32_t tag,
                  Millis timeout) override;
  /** Grouped ncclSend/ncclRecv with every peer (own piece: a device copy). */
  void all_gather_v(const void* in, void* out, const std::vector<std::size_t>& bytes, uint32_t tag,
                    Millis timeout) override;
  void reduce_scatter(const void* in, void* out, std::size_t n_out, DType dtype, ReduceOp op,
                      uint32_t tag, Millis timeout) override;
  /** ncclReduce in place: NCCL writes the receive buffer on the root only. */
  void reduce(void* data, std::size_t n, DType dtype, ReduceOp op, int root, uint32_t tag,
              Millis timeout) override;
  /** Grouped ncclSend/ncclRecv with every peer (own block: a device copy). */
  void all_to_all(const void* in, void* out, std::size_t total_bytes, uint32_t tag,
                  Millis timeout) override;
  /** Refused (std::invalid_argument): a barrier has no tensor, so it runs on Gloo. */
  void barrier(uint32_t tag, Millis timeout) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace quanta::dist::detail
