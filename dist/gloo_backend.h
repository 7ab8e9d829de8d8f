#pragma once
// Gloo over TCP for CPU tensors: one full-mesh context per group. Every call
// takes the tag (see fingerprint.h) and deadline of its collective; sizes
// were agreed before the call. Errors surface as exceptions the group turns
// into DistError. Internal to dist.
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "dist/reduce_kernels.h"
#include "dist/store.h"

namespace gloo {
class Context;
namespace transport {
class Device;
}
}  // namespace gloo

namespace quanta::dist::detail {

class GlooBackend {
 public:
  /** Connects to every peer through `store` (keys scoped by the caller). */
  GlooBackend(Store& store, int rank, int size, Millis timeout, const std::string& host,
              const std::string& iface);
  /** A backend sharing `device` (clones of a group). */
  GlooBackend(Store& store, int rank, int size, Millis timeout,
              std::shared_ptr<gloo::transport::Device> device);
  ~GlooBackend();

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
  void broadcast(void* data, std::size_t bytes, int root, uint32_t tag, Millis timeout);
  void all_gather(const void* in, void* out, std::size_t bytes_per_rank, uint32_t tag,
                  Millis timeout);
  void all_gather_v(const void* in, void* out, const std::vector<std::size_t>& bytes, uint32_t tag,
                    Millis timeout);
  void all_to_all(const void* in, void* out, std::size_t total_bytes, uint32_t tag, Millis timeout);
  void barrier(uint32_t tag, Millis timeout);

  const std::shared_ptr<gloo::transport::Device>& device() const { return device_; }

 private:
  void connect(Store& store, int rank, int size, Millis timeout);
  void pairwise_all_reduce(void* data, std::size_t n, std::size_t elem_size, const ReduceFn& fn,
                           uint32_t tag, Millis timeout);
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;
  std::vector<char> peer_values_;  // pairwise_all_reduce's receive buffer
};

}  // namespace quanta::dist::detail
