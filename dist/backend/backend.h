#pragma once
// The transport under a ProcessGroup: collectives over raw buffers that live
// where the backend works (host memory for Gloo, device memory for NCCL).
// ProcessGroup picks one by tensor device (CPU -> GlooBackend, CUDA ->
// NcclBackend) and does everything tensor-shaped itself: checks, staging of
// non-contiguous tensors, result tensors, fingerprints, failure reports.
// Every call takes the collective's tag (see fingerprint.h; a transport
// without tagged slots ignores it) and deadline; sizes were agreed before the
// call. Failures are exceptions: std::invalid_argument for a call the backend
// refuses (the group stays usable), DistError for one it already reported,
// anything else becomes the group's failure report. Internal to dist.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "dist/process_group.h"
#include "dist/store/store.h"
#include "engine/dtype.h"

namespace quanta::dist::detail {

class Backend {
 public:
  virtual ~Backend() = default;

  /** The transport's name in messages ("gloo", "nccl"). */
  virtual const char* name() const = 0;
  /** Reduces `n` elements of `dtype` at `data` across ranks in place with `op` (avg divides by the
   * world size). */
  virtual void all_reduce(void* data, std::size_t n, DType dtype, ReduceOp op, uint32_t tag,
                          Millis timeout) = 0;
  /** all_reduce of `n` elements at `data` and of `check_n` elements at
   * `check` (the always-on check's region, reduce_check.h: same dtype and
   * op, always in host memory), in one call where the transport can. The
   * default, for transports whose buffers are host memory, reduces them one
   * after the other. */
  virtual void all_reduce_checked(void* data, std::size_t n, void* check, std::size_t check_n,
                                  DType dtype, ReduceOp op, uint32_t tag, Millis timeout) {
    all_reduce(data, n, dtype, op, tag, timeout);
    all_reduce(check, check_n, dtype, op, ~tag, timeout);
  }
  /** Reduces `n` elements of `dtype` at `data` across ranks into rank
   * `root`'s `data` (avg divides by the world size); the other ranks' `data`
   * keep their values. */
  virtual void reduce(void* data, std::size_t n, DType dtype, ReduceOp op, int root, uint32_t tag,
                      Millis timeout) = 0;
  /** Copies `bytes` bytes at `data` from rank `root` to every rank. */
  virtual void broadcast(void* data, std::size_t bytes, int root, uint32_t tag, Millis timeout) = 0;
  /** `out` receives every rank's `bytes_per_rank` bytes of `in`, in rank order. */
  virtual void all_gather(const void* in, void* out, std::size_t bytes_per_rank, uint32_t tag,
                          Millis timeout) = 0;
  /** As all_gather with `bytes[r]` bytes from rank r (this rank sends `bytes[rank]`). */
  virtual void all_gather_v(const void* in, void* out, const std::vector<std::size_t>& bytes,
                            uint32_t tag, Millis timeout) = 0;
  /** `in` holds world-size blocks of `n_out` elements; `out` gets block `rank` reduced across ranks
   * with `op`. */
  virtual void reduce_scatter(const void* in, void* out, std::size_t n_out, DType dtype,
                              ReduceOp op, uint32_t tag, Millis timeout) = 0;
  /** `in` holds world-size equal blocks of `total_bytes` in all: block j goes to rank j, `out`'s
   * block j came from rank j. */
  virtual void all_to_all(const void* in, void* out, std::size_t total_bytes, uint32_t tag,
                          Millis timeout) = 0;
  /** Returns when every rank has called barrier. */
  virtual void barrier(uint32_t tag, Millis timeout) = 0;
  /** Ends this rank's connections after a failed collective, so that a peer
   * blocked on an exchange with this rank fails at once instead of at its
   * timeout. The backend is not used afterwards. No-op by default (NCCL's
   * own error handling aborts its communicator). */
  virtual void close_connections() {}
};

}  // namespace quanta::dist::detail
