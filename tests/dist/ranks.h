#pragma once
// Test helper: N ranks as threads of this process, each with its own
// TcpStore client and ProcessGroup over Gloo on loopback. Every collective
// has a deadline, so run_ranks always returns.
#include <atomic>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dist/process_group.h"
#include "dist/store/store.h"

namespace quanta::dist::testing {

/** What each rank's body threw ("" when it returned normally). */
using RankErrors = std::vector<std::string>;

/** Runs `body(group)` on `n` thread ranks; returns each rank's error text. */
inline RankErrors run_ranks(int n, const std::function<void(ProcessGroup&)>& body,
                            GroupOptions opts = {}) {
  static std::atomic<int> run_id{0};
  TcpStoreServer server(0);
  opts.name = "test" + std::to_string(run_id++);
  if (opts.timeout == std::chrono::minutes(5)) opts.timeout = Millis(3000);
  if (opts.seed == 0) opts.seed = 1234;
  if (opts.debug < 0) opts.debug = 0;
  RankErrors errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto store = std::make_shared<TcpStore>("127.0.0.1", server.port(), false, Millis(5000));
        ProcessGroup group(store, r, n, opts);
        body(group);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        if (errors[r].empty()) errors[r] = "(empty error)";
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

/** True when every rank returned normally; prints the errors otherwise. */
inline bool all_ok(const RankErrors& errors) {
  bool ok = true;
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) {
      ok = false;
      std::fprintf(stderr, "rank %zu: %s\n", r, errors[r].c_str());
    }
  return ok;
}

}  // namespace quanta::dist::testing
