#include "train/progress.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <utility>

namespace quanta::train {

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  char buf[32];
  const auto t = static_cast<int64_t>(std::llround(s));
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(t / 3600),
                  static_cast<long long>(t / 60 % 60));
  else if (t >= 60)
    std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(t / 60),
                  static_cast<long long>(t % 60));
  else
    std::snprintf(buf, sizeof buf, "%llds", static_cast<long long>(t));
  return buf;
}

Progress::Progress(std::ostream& os, bool bar, int64_t start, int64_t total, int64_t items_per_step,
                   std::string unit)
    : os_(os),
      bar_(bar),
      start_(start),
      total_(total),
      batch_(items_per_step),
      unit_(std::move(unit)),
      t0_(std::chrono::steady_clock::now()),
      last_draw_(t0_) {}

double Progress::throughput(int64_t step) const {
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  return dt > 0 ? static_cast<double>((step - start_) * batch_) / dt : 0.0;
}

std::string Progress::status(int64_t step, int64_t epoch, double loss) const {
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  const double per_step = step > start_ ? dt / static_cast<double>(step - start_) : NAN;
  // A device's losses are read once per log window: none yet reads "-".
  char loss_text[32] = "-";
  if (!std::isnan(loss)) std::snprintf(loss_text, sizeof loss_text, "%.5f", loss);
  const std::string window = window_text_.empty() ? "" : "  " + window_text_;
  char buf[256];
  std::snprintf(buf, sizeof buf, "epoch %lld  loss %s%s  %.0f %s/s  eta %s",
                static_cast<long long>(epoch), loss_text, window.c_str(), throughput(step),
                unit_.c_str(),
                format_duration(per_step * static_cast<double>(total_ - step)).c_str());
  return buf;
}

void Progress::update(int64_t step, int64_t epoch, double loss, bool log_line) {
  if (!bar_) {
    if (log_line)
      os_ << "step " << step << "/" << total_ << "  " << status(step, epoch, loss) << "\n"
          << std::flush;
    return;
  }
  const auto now = std::chrono::steady_clock::now();
  if (drawn_ && step < total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  constexpr int kWidth = 24;
  const double frac = total_ > 0 ? static_cast<double>(step) / static_cast<double>(total_) : 1;
  const int filled = std::clamp(static_cast<int>(frac * kWidth), 0, kWidth);
  os_ << "\r\033[K" << step << "/" << total_ << " [" << std::string(filled, '#')
      << std::string(kWidth - filled, '.') << "] " << static_cast<int>(frac * 100) << "%  "
      << status(step, epoch, loss) << std::flush;
  drawn_ = true;
}

void Progress::line(const std::string& text) {
  if (bar_ && drawn_) os_ << "\r\033[K";
  os_ << text << "\n" << std::flush;
  drawn_ = false;
}

void Progress::finish() {
  if (bar_ && drawn_) os_ << "\n" << std::flush;
  drawn_ = false;
}

}  // namespace quanta::train
