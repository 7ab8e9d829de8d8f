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
  step_start_ = std::chrono::steady_clock::now();
  if (steps_ == 0) window_start_ = step_start_;
  step_profile_ = std::make_unique<CallProfile>(s_.timing, !s_.trace_path.empty());
}

bool StepProfile::after(double seconds, bool last) {
  if (!step_profile_) return false;
  step_profile_->stop();
  for (const CallProfileRow& r : step_profile_->rows()) {
    const auto same = [&](const CallProfileRow& o) {
      return o.name == r.name && o.device == r.device;
    };
    const auto at = std::find_if(rows_.begin(), rows_.end(), same);
    if (at == rows_.end()) {
      rows_.push_back(r);
    } else {
      at->calls += r.calls;
      at->seconds += r.seconds;
    }
  }
  calls_ += step_profile_->calls();
  table_seconds_ += step_profile_->seconds();
  if (!s_.trace_path.empty()) {
    const double offset = std::chrono::duration<double>(step_start_ - window_start_).count();
    for (CallEvent& e : step_profile_->events()) {
      e.start += offset;
      events_.push_back(std::move(e));
    }
    step_spans_.emplace_back(offset, seconds);
  }
  step_profile_.reset();
  host_seconds_ += seconds;
  ++steps_;
  last_ = first_ + steps_ - 1;
  if (steps_ < s_.steps && !last) return false;
  ended_ = true;
  std::sort(rows_.begin(), rows_.end(), [](const CallProfileRow& a, const CallProfileRow& b) {
    if (a.seconds != b.seconds) return a.seconds > b.seconds;
    return a.name != b.name ? a.name < b.name : a.device < b.device;
  });
  if (!device_.is_cpu()) {
    const auto t0 = std::chrono::steady_clock::now();
    synchronize(device_);
    drain_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return true;
}

std::vector<std::string> StepProfile::lines(std::size_t top) const {
  std::vector<std::string> out;
  if (!ended_) return out;
  const double n = double(steps_);
  const std::string how =
      s_.timing == CallTiming::device
          ? "each call timed until the device was done with it"
          : (device_.is_cpu() ? "each call timed on the host"
                              : "each call timed on the host, the device's work not waited for");
  std::string summary = "profile of steps " + std::to_string(first_) + " to " +
                        std::to_string(last_) + " (run as called; " + how +
                        "): " + ms(host_seconds_ / n) + " a step on the host, " +
                        ms(table_seconds_ / n) + " of it inside " + fixed(double(calls_) / n, 1) +
                        " table calls a step";
  if (!device_.is_cpu())
    summary += "; the device was done " + ms(drain_seconds_) + " after the last step's calls";
  out.push_back(summary);
  const std::vector<CallProfileRow>& rows = rows_;
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
                  host_seconds_ > 0 ? 100.0 * rows[i].seconds / host_seconds_ : 0.0);
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
  const double n = double(steps_);
  r["kind"] = "profile";
  r["step"] = last_;
  r["first_step"] = first_;
  r["steps"] = steps_;
  r["timing"] = timing_name(s_.timing);
  r["device"] = device_.str();
  r["host_ms_per_step"] = host_seconds_ * 1e3 / n;
  r["table_ms_per_step"] = table_seconds_ * 1e3 / n;
  r["table_calls_per_step"] = double(calls_) / n;
  r["drain_ms"] = drain_seconds_ * 1e3;
  nlohmann::json entries = nlohmann::json::array();
  for (const CallProfileRow& row : rows_)
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
  for (const CallEvent& e : events_) {
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
                        {"steps", steps_}}}};
  std::ofstream out(s_.trace_path, std::ios::trunc);
  out << trace.dump() << "\n";
  out.close();
  if (!out)
    return "profile trace: could not write " + s_.trace_path + " (" + std::strerror(errno) +
           "); the run goes on";
  return "profile trace: " + s_.trace_path + " (" + std::to_string(events_.size()) +
         " calls; open it in ui.perfetto.dev or chrome://tracing)";
}

}  // namespace quanta::train
