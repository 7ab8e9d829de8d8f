#include "dist/backend/gloo_backend.h"

#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <csignal>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>

namespace quanta::dist::detail {
namespace {

// Gloo's Store interface over ours; get() blocks with the deadline because
// connectFullMesh reads some keys without waiting for them first.
class StoreAdapter : public gloo::rendezvous::Store {
 public:
  StoreAdapter(dist::Store& s, Millis timeout) : s_(s), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override { s_.set(key, data); }
  std::vector<char> get(const std::string& key) override { return s_.get(key, timeout_); }
  void wait(const std::vector<std::string>& keys) override { s_.wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    s_.wait(keys, t);
  }

 private:
  dist::Store& s_;
  Millis timeout_;
};

// Gloo's algorithms need only the element size: `f` is called with a value
// of the unsigned type of that size, whose pointers carry the bytes.
template <class F>
void with_element_type(std::size_t elem_size, const char* op, F&& f) {
  switch (elem_size) {
    case 1:
      return f(uint8_t{});
    case 2:
      return f(uint16_t{});
    case 4:
      return f(uint32_t{});
    case 8:
      return f(uint64_t{});
    default:
      throw std::invalid_argument(std::string("[dist::") + op + "] unsupported element size " +
                                  std::to_string(elem_size));
  }
}

}  // namespace

GlooBackend::GlooBackend(Store& store, int rank, int size, Millis timeout, const std::string& host,
                         const std::string& iface) {
  gloo::transport::tcp::attr attr;
  if (!iface.empty())
    attr.iface = iface;
  else
    attr.hostname = host;
  device_ = gloo::transport::tcp::CreateDevice(attr);
  connect(store, rank, size, timeout);
}

GlooBackend::GlooBackend(Store& store, int rank, int size, Millis timeout,
                         std::shared_ptr<gloo::transport::Device> device)
    : device_(std::move(device)) {
  connect(store, rank, size, timeout);
}

namespace {
// Gloo writes to its sockets with writev, which raises SIGPIPE when the peer
// has gone; the default action kills the whole process (every rank thread of
// it) before the group can say which rank was lost. So, once and only when
// nobody installed a handler, SIGPIPE is ignored: the write fails with EPIPE
// and the collective reports the lost rank. (CPython does the same at start.)
void ignore_sigpipe_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction old {};
    if (sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL)
      std::signal(SIGPIPE, SIG_IGN);
  });
}
}  // namespace

void GlooBackend::connect(Store& store, int rank, int size, Millis timeout) {
  ignore_sigpipe_once();
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
  ctx->setTimeout(timeout);
  StoreAdapter adapter(store, timeout);
  ctx->connectFullMesh(adapter, device_);
  context_ = ctx;
}

GlooBackend::~GlooBackend() = default;

void GlooBackend::close_connections() {
  if (context_) context_->closeConnections();
}

void GlooBackend::all_reduce(void* data, std::size_t n, DType dtype, ReduceOp op, uint32_t tag,
                             Millis timeout) {
  all_reduce(data, n, element_size(dtype), reduce_fn(dtype, op), tag, timeout);
  if (op == ReduceOp::avg) divide(data, dtype, n, context_->size);
}

void GlooBackend::all_reduce_checked(void* data, std::size_t n, void* check, std::size_t check_n,
                                     DType dtype, ReduceOp op, uint32_t tag, Millis timeout) {
  const std::size_t elem = element_size(dtype), bytes = n * elem, check_bytes = check_n * elem;
  const auto fn = reduce_fn(dtype, op);
  if (context_->size == 2 && bytes + check_bytes <= kPairwiseBytes) {
    pairwise_all_reduce(data, n, elem, fn, tag, timeout, check, check_n);
  } else if (bytes <= kStagedCheckBytes) {
    if (staged_.size() < bytes + check_bytes) staged_.resize(bytes + check_bytes);
    std::memcpy(staged_.data(), data, bytes);
    std::memcpy(staged_.data() + bytes, check, check_bytes);
    ring_all_reduce(staged_.data(), n + check_n, elem, fn, tag, timeout);
    std::memcpy(data, staged_.data(), bytes);
    std::memcpy(check, staged_.data() + bytes, check_bytes);
  } else {
    ring_all_reduce(data, n, elem, fn, tag, timeout);
    ring_all_reduce(check, check_n, elem, fn, ~tag, timeout);
  }
  // avg divides the region too: its zeros stay zero (reduce_check.h).
  if (op == ReduceOp::avg) {
    divide(data, dtype, n, context_->size);
    divide(check, dtype, check_n, context_->size);
  }
}

void GlooBackend::reduce(void* data, std::size_t n, DType dtype, ReduceOp op, int root,
                         uint32_t tag, Millis timeout) {
  if (n == 0) return;
  const std::size_t elem = element_size(dtype);
  std::unique_ptr<char[]> scratch;
  void* out = data;
  if (context_->rank != root) {
    scratch = std::make_unique_for_overwrite<char[]>(n * elem);
    out = scratch.get();
  }
  gloo::ReduceOptions opts(context_);
  with_element_type(elem, "reduce", [&](auto type) {
    using T = decltype(type);
    opts.setInput(static_cast<T*>(data), n);
    opts.setOutput(static_cast<T*>(out), n);
  });
  opts.setRoot(root);
  opts.setReduceFunction(reduce_fn(dtype, op));
  opts.setTag(tag);
  opts.setTimeout(timeout);
  gloo::reduce(opts);
  if (op == ReduceOp::avg && context_->rank == root) divide(data, dtype, n, context_->size);
}

void GlooBackend::reduce_scatter(const void* in, void* out, std::size_t n_out, DType dtype,
                                 ReduceOp op, uint32_t tag, Millis timeout) {
  const std::size_t size = static_cast<std::size_t>(context_->size);
  const std::size_t block = n_out * element_size(dtype);
  // Block r of the result is rank r's block `rank` of `in`.
  const auto gathered = std::make_unique_for_overwrite<char[]>(block * size);
  all_to_all(in, gathered.get(), block * size, tag, timeout);
  const auto fn = reduce_fn(dtype, op);
  if (block) std::memcpy(out, gathered.get(), block);
  for (std::size_t r = 1; r < size; ++r) fn(out, out, gathered.get() + r * block, n_out);
  if (op == ReduceOp::avg) divide(out, dtype, n_out, context_->size);
}

void GlooBackend::all_reduce(void* data, std::size_t n, std::size_t elem_size, const ReduceFn& fn,
                             uint32_t tag, Millis timeout) {
  if (n == 0) return;
  if (context_->size == 2 && n * elem_size <= kPairwiseBytes)
    pairwise_all_reduce(data, n, elem_size, fn, tag, timeout);
  else
    ring_all_reduce(data, n, elem_size, fn, tag, timeout);
}

void GlooBackend::ring_all_reduce(void* data, std::size_t n, std::size_t elem_size,
                                  const ReduceFn& fn, uint32_t tag, Millis timeout) {
  if (n == 0) return;
  gloo::AllreduceOptions opts(context_);
  with_element_type(elem_size, "all_reduce",
                    [&](auto type) { opts.setOutput(static_cast<decltype(type)*>(data), n); });
  opts.setReduceFunction(fn);
  opts.setTag(tag);
  opts.setTimeout(timeout);
  gloo::allreduce(opts);
}

// Gloo's ring on two ranks is a reduce-scatter then an all-gather: two
// dependent rounds of messages for the same bytes one exchange moves. Each
// round costs a wake-up of the peer's I/O thread and of the caller, which on
// loopback dominates small and medium buffers (measured on the project VM:
// 4 KB 0.36-0.43 of the ring's time, 1 MiB 0.68-0.96; see docs/dist.md).
void GlooBackend::pairwise_all_reduce(void* data, std::size_t n, std::size_t elem_size,
                                      const ReduceFn& fn, uint32_t tag, Millis timeout, void* check,
                                      std::size_t check_n) {
  const std::size_t bytes = n * elem_size, check_bytes = check_n * elem_size;
  if (peer_values_.size() < bytes + check_bytes) peer_values_.resize(bytes + check_bytes);
  const int rank = context_->rank, peer = 1 - rank;
  // Gloo's own collectives use slot prefixes 0x01-0x08; these are ours.
  constexpr uint8_t kPairwiseSlotPrefix = 0x51, kCheckSlotPrefix = 0x52;
  const gloo::Slot slot = gloo::Slot::build(kPairwiseSlotPrefix, tag);
  // The check region goes in the same round. Small buffers copy the data in
  // front of it and send one message (a second message can cost the peer a
  // second wake-up); larger ones send it as a second message, without a copy.
  const bool one_message = check_bytes && bytes <= kOneMessageBytes;
  void* send_from = data;
  if (one_message) {
    if (staged_.size() < bytes + check_bytes) staged_.resize(bytes + check_bytes);
    std::memcpy(staged_.data(), data, bytes);
    std::memcpy(staged_.data() + bytes, check, check_bytes);
    send_from = staged_.data();
  }
  const std::size_t first = one_message ? bytes + check_bytes : bytes;
  auto mine = context_->createUnboundBuffer(send_from, first);
  auto theirs = context_->createUnboundBuffer(peer_values_.data(), first);
  theirs->recv(peer, slot);
  mine->send(peer, slot);
  std::unique_ptr<gloo::transport::UnboundBuffer> my_check, their_check;
  if (check_bytes && !one_message) {
    const gloo::Slot check_slot = gloo::Slot::build(kCheckSlotPrefix, tag);
    my_check = context_->createUnboundBuffer(check, check_bytes);
    their_check = context_->createUnboundBuffer(peer_values_.data() + bytes, check_bytes);
    their_check->recv(peer, check_slot);
    my_check->send(peer, check_slot);
  }
  // Gloo throws on a timeout or a broken pair; false means aborted.
  const auto aborted = [&] {
    throw std::runtime_error("the exchange with rank " + std::to_string(peer) + " was aborted");
  };
  if (!theirs->waitRecv(timeout) || !mine->waitSend(timeout)) aborted();
  if (my_check && (!their_check->waitRecv(timeout) || !my_check->waitSend(timeout))) aborted();
  // Rank 0's values first on both ranks: the same operands in the same order.
  const char* peer_data = peer_values_.data();
  if (rank == 0) {
    fn(data, data, peer_data, n);
    if (check_n) fn(check, check, peer_data + bytes, check_n);
  } else {
    fn(data, peer_data, data, n);
    if (check_n) fn(check, peer_data + bytes, check, check_n);
  }
}

bool GlooBackend::ring_exchange(const void* mine, void* theirs, std::size_t bytes, uint32_t tag,
                                Millis timeout, const std::function<void()>& between,
                                int chain_start) {
  const int n = context_->size, rank = context_->rank;
  const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
  const bool receives = rank != chain_start, sends = next != chain_start;
  // Ours, like pairwise_all_reduce's (Gloo's collectives use 0x01-0x08).
  constexpr uint8_t kRingSlotPrefix = 0x53;
  const gloo::Slot slot = gloo::Slot::build(kRingSlotPrefix, tag);
  std::unique_ptr<gloo::transport::UnboundBuffer> out, in;
  if (receives) {
    in = context_->createUnboundBuffer(theirs, bytes);
    in->recv(prev, slot);
  }
  if (sends) {
    out = context_->createUnboundBuffer(const_cast<void*>(mine), bytes);
    out->send(next, slot);
  }
  between();
  // Gloo throws on a timeout or a broken pair; false means aborted.
  if ((in && !in->waitRecv(timeout)) || (out && !out->waitSend(timeout)))
    throw std::runtime_error("the check exchange with ranks " + std::to_string(prev) + " and " +
                             std::to_string(next) + " was aborted");
  return receives;
}

void GlooBackend::broadcast(void* data, std::size_t bytes, int root, uint32_t tag, Millis timeout) {
  if (bytes == 0) return;
  gloo::BroadcastOptions opts(context_);
  opts.setOutput(static_cast<uint8_t*>(data), bytes);
  opts.setRoot(root);
  opts.setTag(tag);
  opts.setTimeout(timeout);
  gloo::broadcast(opts);
}

void GlooBackend::all_gather(const void* in, void* out, std::size_t bytes_per_rank, uint32_t tag,
                             Millis timeout) {
  if (bytes_per_rank == 0) return;
  gloo::AllgatherOptions opts(context_);
  opts.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(in)), bytes_per_rank);
  opts.setOutput(static_cast<uint8_t*>(out), bytes_per_rank * context_->size);
  opts.setTag(tag);
  opts.setTimeout(timeout);
  gloo::allgather(opts);
}

void GlooBackend::all_gather_v(const void* in, void* out, const std::vector<std::size_t>& bytes,
                               uint32_t tag, Millis timeout) {
  std::size_t total = 0;
  for (auto b : bytes) total += b;
  if (total == 0) return;
  gloo::AllgathervOptions opts(context_);
  opts.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(in)), bytes[context_->rank]);
  opts.setOutput(static_cast<uint8_t*>(out), bytes);
  opts.setTag(tag);
  opts.setTimeout(timeout);
  gloo::allgatherv(opts);
}

void GlooBackend::all_to_all(const void* in, void* out, std::size_t total_bytes, uint32_t tag,
                             Millis timeout) {
  if (total_bytes == 0) return;
  gloo::AlltoallOptions opts(context_);
  opts.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(in)), total_bytes);
  opts.setOutput(static_cast<uint8_t*>(out), total_bytes);
  opts.setTag(tag);
  opts.setTimeout(timeout);
  gloo::alltoall(opts);
}

void GlooBackend::barrier(uint32_t tag, Millis timeout) {
  gloo::BarrierOptions opts(context_);
  opts.setTag(tag);
  opts.setTimeout(timeout);
  gloo::barrier(opts);
}

}  // namespace quanta::dist::detail
