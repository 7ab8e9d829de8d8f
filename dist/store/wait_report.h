#pragma once
// When a rank waits for others (the store server, ranks that have not
// joined), it says so on stderr: after 3 s, then every 30 s, so a lone rank
// is never silent until its timeout. WaitReport keeps that schedule.
#include <chrono>
#include <string>

#include "dist/store/store.h"

namespace quanta::dist::detail {

class WaitReport {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr Millis kFirst{3000};
  static constexpr Millis kEvery{30000};

  explicit WaitReport(Millis timeout)
      : start_(Clock::now()), next_(start_ + kFirst), timeout_(timeout) {}
  /** True when a line is due (then the next one is kEvery later). */
  bool due() {
    const auto now = Clock::now();
    if (now < next_) return false;
    next_ = now + kEvery;
    return true;
  }
  /** "waited 3 s of 300 s". */
  std::string waited() const {
    using std::chrono::duration_cast;
    using std::chrono::seconds;
    return "waited " + std::to_string(duration_cast<seconds>(Clock::now() - start_).count()) +
           " s of " + seconds_text(timeout_);
  }

 private:
  static std::string seconds_text(Millis t) {
    return t.count() % 1000 == 0 ? std::to_string(t.count() / 1000) + " s"
                                 : std::to_string(t.count()) + " ms";
  }
  Clock::time_point start_, next_;
  Millis timeout_;
};

}  // namespace quanta::dist::detail
