#pragma once
// Gloo over TCP for CPU tensors: one full-mesh context per group. Every call
// takes the tag (see fingerprint.h) and deadline of its collective; sizes
// were agreed before the call. Errors surface as exceptions the group turns
// into DistError. Internal to dist.
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dist/backend/backend.h"
#include "dist/backend/reduce_kernels.h"
#include "dist/store/store.h"

namespace gloo {
class Context;
namespace transport {
class Device;
}
}  // namespace gloo

namespace quanta::dist::detail {

class GlooBackend final : public Backend {
 public:
  /** Connects to every peer through `store` (keys scoped by the caller). */
  GlooBackend(Store& store, int rank, int size, Millis timeout, const std::string& host,
              const std::string& iface);
  /** A backend sharing `device` (clones of a group). */
  GlooBackend(Store& store, int rank, int size, Millis timeout,
              std::shared_ptr<gloo::transport::Device> device);
  ~GlooBackend() override;
  GlooBackend(const GlooBackend&) = delete;
  GlooBackend& operator=(const GlooBackend&) = delete;

  // ---- Backend: (dtype, op) become a ReduceFn (reduce_kernels.h); avg sums,
  // then divides by the world size on every rank ----
  const char* name() const override { return "gloo"; }
  void close_connections() override;
  void all_reduce(void* data, std::size_t n, DType dtype, ReduceOp op, uint32_t tag,
                  Millis timeout) override;
  /** Two ranks up to kPairwiseBytes: the check region travels in the same
   * exchange as the data (no extra round; see kOneMessageBytes). The ring:
   * copied behind the data up to kStagedCheckBytes, else a second ring. */
  void all_reduce_checked(void* data, std::size_t n, void* check, std::size_t check_n, DType dtype,
                          ReduceOp op, uint32_t tag, Millis timeout) override;
  /** Gloo's ring reduce: a reduce-scatter, then the chunks to the root.
   * Gloo uses the output as scratch on every rank, so the other ranks
   * reduce into a buffer of their own and keep `data`. */
  void reduce(void* data, std::size_t n, DType dtype, ReduceOp op, int root, uint32_t tag,
              Millis timeout) override;
  void broadcast(void* data, std::size_t bytes, int root, uint32_t tag, Millis timeout) override;
  void all_gather(const void* in, void* out, std::size_t bytes_per_rank, uint32_t tag,
                  Millis timeout) override;
  void all_gather_v(const void* in, void* out, const std::vector<std::size_t>& bytes, uint32_t tag,
                    Millis timeout) override;
  /** All-to-all, then a local reduction of the blocks in rank order: the
   * bandwidth of a ring reduce-scatter (Gloo 5b14351 has none of its own). */
  void reduce_scatter(const void* in, void* out, std::size_t n_out, DType dtype, ReduceOp op,
                      uint32_t tag, Millis timeout) override;
  void all_to_all(const void* in, void* out, std::size_t total_bytes, uint32_t tag,
                  Millis timeout) override;
  void barrier(uint32_t tag, Millis timeout) override;

  // ---- raw reductions (the Backend all_reduce's transport; benchmarks) ----
  /** Two ranks and at most kPairwiseBytes: one exchange of the whole
   * buffer, then each rank reduces rank 0's values with rank 1's in that
   * order (bitwise equal on both). Otherwise Gloo's ring. */
  void all_reduce(void* data, std::size_t n, std::size_t elem_size, const ReduceFn& fn,
                  uint32_t tag, Millis timeout);
  /** Gloo's ring allreduce, whatever the world size (the benchmark's peer). */
  void ring_all_reduce(void* data, std::size_t n, std::size_t elem_size, const ReduceFn& fn,
                       uint32_t tag, Millis timeout);
  /** Above this, two ranks use the ring too: bandwidth-bound either way, and
   * the exchange's receive buffer (kept between calls) stays this small. */
  static constexpr std::size_t kPairwiseBytes = std::size_t(4) << 20;
  /** Up to this, the exchange copies the data in front of the check region
   * and sends one message; above, the region is a second message. */
  static constexpr std::size_t kOneMessageBytes = std::size_t(64) << 10;
  /** Up to this, a ring all_reduce_checked copies the data next to the
   * check region (cheaper than a second ring); above, it runs two rings. */
  static constexpr std::size_t kStagedCheckBytes = std::size_t(1) << 20;

  /** Sends `bytes` at `mine` to the next rank of the ring ((rank + 1) mod N)
   * and receives the previous rank's into `theirs`: posted before `between`
   * runs and awaited after it, so the two small messages overlap whatever
   * `between` moves (a check beside a collective's payload, without copying
   * the payload or a round of its own after it). With `chain_start` >= 0 the
   * ring is cut before that rank: it receives nothing and its predecessor
   * sends nothing (a chain still links every rank, so equal neighbours still
   * mean all equal), which spares a broadcast's root from waiting on the
   * others. Returns whether `theirs` was received. */
  bool ring_exchange(const void* mine, void* theirs, std::size_t bytes, uint32_t tag,
                     Millis timeout, const std::function<void()>& between, int chain_start = -1);

  const std::shared_ptr<gloo::transport::Device>& device() const { return device_; }

 private:
  void connect(Store& store, int rank, int size, Millis timeout);
  /** The exchange of `n` elements at `data` and `check_n` at `check`. */
  void pairwise_all_reduce(void* data, std::size_t n, std::size_t elem_size, const ReduceFn& fn,
                           uint32_t tag, Millis timeout, void* check = nullptr,
                           std::size_t check_n = 0);
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;
  std::vector<char> peer_values_;  // pairwise_all_reduce's receive buffer
  std::vector<char> staged_;       // data + check region, up to kStagedCheckBytes + check
};

}  // namespace quanta::dist::detail
