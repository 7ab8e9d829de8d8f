#include "train/step_profile.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "engine/device_backend.h"

namespace quanta::train {
namespace {

// Steps a run takes before its window: the first initialises (k-means,
// the optimizer's state, cuDNN's plans), the second is the first steady one.
constexpr int64_t kProfileAfterSteps = 2;

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string ms(double seconds) { return fixed(seconds * 1e3, 3) + " ms"; }

std::string timing_name(CallTiming t) { return t == CallTiming::device ? "device" : "host"; }

// "cpu", "cuda" or "sim": Device::str() without the index.
std::string type_name(DeviceType t) {
  const std::string s = Device{t, 0}.str();
  return s.substr(0, s.find(':'));
}

}  // namespace

StepProfile::StepProfile(const ProfileSettings& s, Device device, int64_t done_steps,
                         int64_t total_steps)
    : s_(s), device_(device) {
  const int64_t left = total_steps - done_steps;
  if (s_.steps <= 0 || left <= 0) return;
  // A shorter run profiles its last steps, at least one.
  const int64_t skip = std::clamp<int64_t>(left - s_.steps, 0, kProfileAfterSteps);
  first_ = done_steps + skip + 1;
}

void StepProfile::before(int64_t step) {
  if (first_ <= 0 || ended_ || step < first_) return;
  if (profile_) {
    profile_->resume();
  } else {
    window_start_ = std::chrono::steady_clock::now();
    profile_ = std::make_unique<CallProfile>(s_.timing, !s_.trace_path.empty());
  }
  step_spans_.emplace_back(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - window_start_).count(), 0);
}

bool StepProfile::after(double seconds, bool last) {
  if (!profile_ || !profile_->running()) return false;
  profile_->stop();
  step_spans_.back().second = seconds;
  if (steps() < s_.steps && !last) return false;
  ended_ = true;
  if (!device_.is_cpu()) {
    const auto t0 = std::chrono::steady_clock::now();
    synchronize(device_);
    drain_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return true;
}

double StepProfile::host_seconds() const {
  double sum = 0;
  for (const auto& span : step_spans_) sum += span.second;
  return sum;
}

std::vector<std::string> StepProfile::lines(std::size_t top) const {
  std::vector<std::string> out;
  if (!ended_) return out;
  const double n = double(steps());
  const std::string how =
      s_.timing == CallTiming::device
          ? "each call timed until the device was done with it"
          : (device_.is_cpu() ? "each call timed on the host"
                              : "each call timed on the host, the device's work not waited for");
  std::string summary = "profile of steps " + std::to_string(first_) + " to " +
                        std::to_string(last()) + " (run as called; " + how +
                        "): " + ms(host_seconds() / n) + " a step on the host, " +
                        ms(profile_->seconds() / n) + " of it inside " +
                        fixed(double(profile_->calls()) / n, 1) + " table calls a step";
  if (!device_.is_cpu())
    summary += "; the device was done " + ms(drain_seconds_) + " after the last step's calls";
  out.push_back(summary);
  const std::vector<CallProfileRow> rows = profile_->rows();
  // A row of another device's table (the batch gathered on the host) says so.
  const auto shown_name = [&](const CallProfileRow& r) {
    return r.device == device_.type ? r.name : r.name + " (" + type_name(r.device) + ")";
  };
  char buf[160];
  std::snprintf(buf, sizeof buf, "  %-32s %12s %10s %7s", "entry", "calls/step", "ms/step",
                "share");
  out.emplace_back(buf);
  double rest = 0;
  std::size_t rest_rows = 0;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (i >= top) {
      rest += rows[i].seconds;
      ++rest_rows;
      continue;
    }
    std::snprintf(buf, sizeof buf, "  %-32s %12.1f %10.3f %6.1f%%", shown_name(rows[i]).c_str(),
                  double(rows[i].calls) / n, rows[i].seconds * 1e3 / n,
                  host_seconds() > 0 ? 100.0 * rows[i].seconds / host_seconds() : 0.0);
    out.emplace_back(buf);
  }
  if (rest_rows > 0)
    out.push_back("  (" + std::to_string(rest_rows) + " more entries: " + ms(rest / n) +
                  " a step)");
  return out;
}

nlohmann::json StepProfile::record() const {
  nlohmann::json r = nlohmann::json::object();
  if (!ended_) return r;
  const double n = double(steps());
  r["kind"] = "profile";
  r["step"] = last();
  r["first_step"] = first_;
  r["steps"] = steps();
  r["timing"] = timing_name(s_.timing);
  r["device"] = device_.str();
  r["host_ms_per_step"] = host_seconds() * 1e3 / n;
  r["table_ms_per_step"] = profile_->seconds() * 1e3 / n;
  r["table_calls_per_step"] = double(profile_->calls()) / n;
  r["drain_ms"] = drain_seconds_ * 1e3;
  nlohmann::json entries = nlohmann::json::array();
  for (const CallProfileRow& row : profile_->rows())
    entries.push_back({{"name", row.name},
                       {"device", type_name(row.device)},
                       {"calls_per_step", double(row.calls) / n},
                       {"ms_per_step", row.seconds * 1e3 / n}});
  r["entries"] = std::move(entries);
  return r;
}

std::string StepProfile::write_trace() const {
  if (!ended_ || s_.trace_path.empty()) return "";
  // Chrome's trace event format: complete events ("X") in microseconds, a
  // thread each calling thread (quanta's numbers), the steps on one more.
  using nlohmann::json;
  json events = json::array();
  int steps_thread = 0;
  const std::vector<CallEvent> calls = profile_->events();
  for (const CallEvent& e : calls) {
    steps_thread = std::max(steps_thread, e.thread + 1);
    events.push_back({{"name", e.name},
                      {"cat", e.name.substr(0, e.name.find('.'))},
                      {"ph", "X"},
                      {"ts", e.start * 1e6},
                      {"dur", e.seconds * 1e6},
                      {"pid", 0},
                      {"tid", e.thread},
                      {"args", {{"device", type_name(e.device)}}}});
  }
  for (std::size_t i = 0; i < step_spans_.size(); ++i)
    events.push_back({{"name", "step " + std::to_string(first_ + int64_t(i))},
                      {"cat", "step"},
                      {"ph", "X"},
                      {"ts", step_spans_[i].first * 1e6},
                      {"dur", step_spans_[i].second * 1e6},
                      {"pid", 0},
                      {"tid", steps_thread}});
  events.push_back({{"name", "thread_name"},
                    {"ph", "M"},
                    {"pid", 0},
                    {"tid", steps_thread},
                    {"args", {{"name", "steps (host)"}}}});
  const json trace = {{"traceEvents", events},
                      {"displayTimeUnit", "ms"},
                      {"otherData",
                       {{"device", device_.str()},
                        {"timing", timing_name(s_.timing)},
                        {"first_step", first_},
                        {"steps", steps()}}}};
  std::ofstream out(s_.trace_path, std::ios::trunc);
  out << trace.dump() << "\n";
  out.close();
  if (!out)
    return "profile trace: could not write " + s_.trace_path + " (" + std::strerror(errno) +
           "); the run goes on";
  return "profile trace: " + s_.trace_path + " (" + std::to_string(calls.size()) +
         " calls; open it in ui.perfetto.dev or chrome://tracing)";
}

}  // namespace quanta::train
