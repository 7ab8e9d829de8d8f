// ProcessGroup::Checks: the debug fingerprint exchange, the always-on
// check's inline, ring and reduction forms, and the reports of a mismatch.
#include "dist/call_checks.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "dist/backend/gloo_backend.h"
#include "dist/backend/reduce_kernels.h"
#include "dist/reduce_check.h"
#include "engine/factory.h"
#include "engine/random/generator.h"

namespace quanta::dist {

using detail::Fingerprint;

using Clock = std::chrono::steady_clock;

std::string detail::status_key(int rank) { return "status/" + std::to_string(rank); }

std::vector<std::optional<Bytes>> detail::await_posts(Store& store, int rank, int size,
                                                      const std::string& prefix, Millis grace) {
  std::vector<std::optional<Bytes>> posts(size);
  const auto deadline = Clock::now() + grace;
  for (;;) {
    bool all = true;
    for (int r = 0; r < size; ++r) {
      if (r == rank || posts[r]) continue;
      const std::string key = prefix + std::to_string(r);
      if (store.check(key))
        posts[r] = store.get(key, Millis(1000));
      else
        all = false;
    }
    if (all || Clock::now() >= deadline) return posts;
    std::this_thread::sleep_for(Millis(20));
  }
}

Millis detail::grace_of(Millis timeout) {
  return std::clamp(timeout / 2, Millis(300), Millis(2000));
}

std::vector<char> ProcessGroup::Checks::debug_exchange(const Call& call, const void* payload,
                                                       std::size_t bytes) {
  std::vector<char> mine(kDebugBlock, 0), all(kDebugBlock * static_cast<std::size_t>(g_.size_));
  std::memcpy(mine.data(), &call.fp, sizeof(Fingerprint));
  if (bytes) std::memcpy(mine.data() + sizeof(Fingerprint), payload, bytes);
  const uint32_t tag = static_cast<uint32_t>(quanta::detail::splitmix64(call.fp.seq ^ 0x6670ull));
  g_.guarded(
      call, [&] { g_.gloo_->all_gather(mine.data(), all.data(), kDebugBlock, tag, call.timeout); });
  std::vector<Fingerprint> fps(g_.size_);
  for (int r = 0; r < g_.size_; ++r)
    std::memcpy(&fps[r], all.data() + r * kDebugBlock, sizeof(Fingerprint));
  compare_debug(call, fps);
  return all;
}

void ProcessGroup::Checks::fingerprints_before(const Call& call) {
  debug_exchange(call, nullptr, 0);
}

void ProcessGroup::Checks::compare_debug(const Call& call, const std::vector<Fingerprint>& all) {
  const std::string diff = detail::compare(all);
  if (diff.empty()) return;
  g_.broken_ = "QUANTA_DIST_DEBUG: " + diff;
  throw DistError("[dist] " + call.desc() + " on rank " + std::to_string(g_.rank_) + " of " +
                  std::to_string(g_.size_) + ": " + g_.broken_);
}

void ProcessGroup::Checks::fused_debug_all_reduce(const Call& c, const Tensor& buf, ReduceOp op) {
  const std::size_t nbytes = buf.nbytes();
  const std::vector<char> all = debug_exchange(c, buf.raw_data(), nbytes);
  // The same reduction in rank order on every rank: bitwise equal results.
  const std::size_t n = static_cast<std::size_t>(buf.numel());
  const auto fn = detail::reduce_fn(buf.dtype(), op);
  const char* data0 = all.data() + sizeof(Fingerprint);
  std::memcpy(buf.raw_data(), data0, nbytes);
  for (int r = 1; r < g_.size_; ++r) fn(buf.raw_data(), buf.raw_data(), data0 + r * kDebugBlock, n);
}

void ProcessGroup::Checks::mismatch(const Call& call, const std::string& diff) {
  g_.broken_ = diff;
  // A rank that fails later in another call (the root of a broadcast
  // learns nothing from it) reads why this one left.
  try {
    g_.store_->set_string(detail::status_key(g_.rank_), "failed the check of " + call.desc() +
                                                            ": the ranks called different "
                                                            "collectives");
  } catch (...) {
  }
  throw DistError("[dist] " + call.desc() + " on rank " + std::to_string(g_.rank_) + " of " +
                  std::to_string(g_.size_) + ": " + diff);
}

void ProcessGroup::Checks::reduction_mismatch(const Call& call) {
  // Every rank of a reduction sees the same result, so all of them are
  // here: each posts its fingerprint and reads the others'.
  std::vector<Fingerprint> fps;
  std::vector<int> ranks, silent;
  const Millis grace = detail::grace_of(call.timeout);
  std::string trouble;
  try {
    const auto* p = reinterpret_cast<const char*>(&call.fp);
    g_.store_->set("fingerprint/" + std::to_string(g_.rank_), Bytes(p, p + sizeof(Fingerprint)));
    const auto posts = detail::await_posts(*g_.store_, g_.rank_, g_.size_, "fingerprint/", grace);
    for (int r = 0; r < g_.size_; ++r) {
      if (r == g_.rank_) {
        fps.push_back(call.fp);
        ranks.push_back(r);
      } else if (posts[r] && posts[r]->size() == sizeof(Fingerprint)) {
        Fingerprint f;
        std::memcpy(&f, posts[r]->data(), sizeof f);
        fps.push_back(f);
        ranks.push_back(r);
      } else {
        silent.push_back(r);
      }
    }
  } catch (const std::exception& e) {
    trouble = e.what();
  }
  if (fps.empty()) {
    fps.push_back(call.fp);
    ranks.push_back(g_.rank_);
  }
  std::string diff = detail::compare(fps, ranks);
  if (diff.empty()) diff = "ranks called different collectives: the check of the reduction failed";
  if (!silent.empty()) {
    diff += "\n  ranks that did not say which call they were in within " +
            std::to_string(grace.count()) + " ms: ";
    for (std::size_t i = 0; i < silent.size(); ++i)
      diff += (i ? ", " : "") + std::to_string(silent[i]);
  }
  if (!trouble.empty()) diff += "\n  (could not ask the other ranks: " + trouble + ")";
  mismatch(call, diff);
}

namespace {
// Up to this many payload bytes the check travels inside the payload of
// broadcast, all_gather, all_to_all and reduce_scatter: the payload is
// copied into a staging buffer with room for it. Above it, the copies (up to
// world size + 1 payloads for the gathers) cost more than a second small
// call (measured on the 2-core VM: copying 1 MiB twice ~0.1 ms, a small
// round trip ~0.05-0.1 ms), so the data moves as before and the
// fingerprints go round the ring beside it, in two small messages per rank
// that overlap the data (beside_ring, sub-tag kCheckTag; before,
// a gather of the fingerprints after the data cost 12-25% at 1 MiB).
// all_reduce sends its check region through Backend::all_reduce_checked.
constexpr std::size_t kInlineCheckBytes = std::size_t(64) << 10;
constexpr uint32_t kCheckTag = 0xC5;
}  // namespace

bool ProcessGroup::Checks::inline_ok(std::size_t payload_bytes) {
  return payload_bytes <= kInlineCheckBytes;
}

Tensor ProcessGroup::Checks::staging(std::size_t bytes, Device device) {
  if (staging_.defined() && staging_.device() == device && staging_.nbytes() >= bytes)
    return staging_;
  // Only inline checks stage, so this stays small (world size + 1 blocks of
  // at most kInlineCheckBytes); keeping it spares an allocation per call.
  staging_ = quanta::detail::make_tensor({static_cast<int64_t>(bytes)}, DType::u8, device);
  return staging_;
}

void ProcessGroup::Checks::reduction_after(const Call& c, DType dtype, ReduceOp op) {
  // The region alone, on the host transport: reduced exactly as it would
  // have been inside the payload.
  std::vector<char> region = detail::check_region(c.word, dtype);
  g_.guarded(c, [&] {
    g_.gloo().all_reduce(region.data(), detail::kCheckElems, dtype, op,
                         detail::sub_tag(c.tag, kCheckTag), c.timeout);
  });
  if (!detail::check_region_holds(region.data(), c.word, dtype, op)) reduction_mismatch(c);
}

void ProcessGroup::Checks::beside_ring(const Call& c, const std::function<void()>& run, int root) {
  Fingerprint previous{};
  bool received = false;
  g_.guarded(c, [&] {
    received = g_.gloo().ring_exchange(&c.fp, &previous, sizeof(Fingerprint),
                                       detail::sub_tag(c.tag, kCheckTag), c.timeout, run, root);
  });
  if (!received) return;
  // Named lower rank first, as a gather of every fingerprint would name them.
  const int before = (g_.rank_ + g_.size_ - 1) % g_.size_;
  const std::string diff = before < g_.rank_
                               ? detail::compare({previous, c.fp}, {before, g_.rank_})
                               : detail::compare({c.fp, previous}, {g_.rank_, before});
  if (!diff.empty()) mismatch(c, diff);
}

}  // namespace quanta::dist
