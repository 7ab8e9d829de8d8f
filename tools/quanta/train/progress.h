#pragma once
// Training progress: a redrawn bar on a terminal (steps, loss, throughput,
// ETA), one plain line every `log_every` steps otherwise.
#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <utility>

namespace quanta::train {

/** "2m15s", "1h02m", "12s". */
std::string format_duration(double seconds);

class Progress {
 public:
  /** Steps run from `start` to `total`; `bar` redraws one line in place.
   * Each step handles `items_per_step` of `unit` ("img", "tokens"). */
  Progress(std::ostream& os, bool bar, int64_t start, int64_t total, int64_t items_per_step,
           std::string unit = "img");
  /** Reports that `step` steps are done with this recent mean `loss` (NaN:
   * not read yet, shown as "-"). Draws the bar (at most ~10 times a second)
   * or, when `log_line`, a plain line. */
  void update(int64_t step, int64_t epoch, double loss, bool log_line);
  /** Figures of the last log window shown after the loss from now on (e.g.
   * "psnr 21.37 dB"); empty shows none. */
  void set_window_text(std::string text) { window_text_ = std::move(text); }
  /** Prints a full line (clearing the bar first). */
  void line(const std::string& text);
  /** Items (images, tokens) per second since the start. */
  double throughput(int64_t step) const;
  /** Ends the bar's line. */
  void finish();

 private:
  std::string status(int64_t step, int64_t epoch, double loss) const;

  std::ostream& os_;
  bool bar_;
  int64_t start_, total_, batch_;
  std::string unit_;
  std::string window_text_;
  std::chrono::steady_clock::time_point t0_, last_draw_;
  bool drawn_ = false;
};

}  // namespace quanta::train
