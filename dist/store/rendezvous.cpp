#include "dist/store/rendezvous.h"

#include <unistd.h>

#include <cstdio>
#include <stdexcept>
#include <thread>
#include <vector>

#include "dist/store/wait_report.h"

namespace quanta::dist::detail {
namespace {

using Clock = std::chrono::steady_clock;

// Keys under the group's prefix.
std::string claim_key(int r) { return "join/claim/" + std::to_string(r); }
std::string who_key(int r) { return "join/who/" + std::to_string(r); }
constexpr const char* kJoined = "join/count";
constexpr const char* kAllJoined = "join/all";
// What a duplicate adds to join/count: more than any world size, so the one
// atomic add says whether the group had formed before the duplicate came.
constexpr int64_t kDuplicateWeight = int64_t(1) << 40;
constexpr const char* kDuplicate = "join/duplicate";  // the message, once a rank was claimed twice

std::string this_process() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return "pid " + std::to_string(::getpid()) + " on " + host;
}

// "1, 2, 5" (at most 16 listed).
std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (std::size_t i = 0; i < ranks.size() && i < 16; ++i)
    s += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > 16) s += ", ... (" + std::to_string(ranks.size()) + " in all)";
  return s;
}

std::vector<int> missing_ranks(Store& store, int size) {
  std::vector<int> missing;
  for (int r = 0; r < size; ++r)
    if (!store.check(claim_key(r))) missing.push_back(r);
  return missing;
}

}  // namespace

void check_no_duplicate(Store& store) {
  if (!store.check(kDuplicate)) return;
  const std::string msg = store.get_string(kDuplicate, Millis(1000));
  // This rank may host the store (rank 0): stay a moment, so the other
  // waiting ranks read the message at their next poll instead of finding
  // the store gone.
  std::this_thread::sleep_for(Millis(500));
  throw std::runtime_error(msg);
}

void join_group(Store& store, int rank, int size, Millis timeout, const std::string& where) {
  const std::string me = this_process();
  if (store.add(claim_key(rank), 1) > 1) {
    // Someone holds this rank already: tell every rank of the group (they
    // look for this key while they wait, and once more after connecting).
    std::string first = "another process";
    try {
      first = store.get_string(who_key(rank), Millis(1000));
    } catch (const std::exception&) {
    }
    const std::string msg = "rank " + std::to_string(rank) + " was started twice: " + first +
                            " and " + me + " both joined " + where + " as rank " +
                            std::to_string(rank) +
                            ". Start each rank once: check RANK (or the launcher's rank "
                            "variables) of every process";
    // Before the group formed, every rank fails with this message. After
    // (all `size` ranks had added 1 first), the group carries on: its ranks
    // may already be connecting to each other, and failing some of them would
    // leave the rest waiting out their timeout. The duplicate fails alone.
    if (store.add(kJoined, kDuplicateWeight) - kDuplicateWeight < size)
      store.set_string(kDuplicate, msg);
    throw std::runtime_error(msg);
  }
  store.set_string(who_key(rank), me);
  check_no_duplicate(store);
  // Exactly `size` only when every rank joined before any duplicate did.
  if (store.add(kJoined, 1) == size) store.set_string(kAllJoined, "1");
  const auto deadline = Clock::now() + timeout;
  WaitReport report(timeout);
  for (auto sleep = Millis(1); !store.check(kAllJoined); sleep = std::min(sleep * 2, Millis(50))) {
    check_no_duplicate(store);
    if (Clock::now() >= deadline) {
      const auto missing = missing_ranks(store, size);
      throw std::runtime_error(
          "timed out after " + std::to_string(timeout.count()) + " ms waiting at " + where +
          " for " + (missing.size() == 1 ? "rank " : "ranks ") + rank_list(missing) + " to join (" +
          std::to_string(size - int(missing.size())) + " of " + std::to_string(size) +
          " joined): did they start, with the same MASTER_ADDR, "
          "MASTER_PORT and WORLD_SIZE?");
    }
    if (report.due()) {
      const auto missing = missing_ranks(store, size);
      std::fprintf(
          stderr, "[dist] rank %d of %d: waiting at %s for %s %s to join (%d of %d joined; %s)\n",
          rank, size, where.c_str(), missing.size() == 1 ? "rank" : "ranks",
          rank_list(missing).c_str(), size - int(missing.size()), size, report.waited().c_str());
    }
    std::this_thread::sleep_for(sleep);
  }
  check_no_duplicate(store);
}

}  // namespace quanta::dist::detail
