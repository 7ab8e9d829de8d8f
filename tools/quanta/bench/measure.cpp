// What every bench suite shares: timing (medians, interleaved rounds), the
// memory-bandwidth floor, and the report.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <ostream>

#include "bench.h"
#include "engine/cpu/parallel.h"

namespace quanta::cli {

double median_ms(int repeat, const std::function<void()>& fn) {
  using clock = std::chrono::steady_clock;
  fn();  // warm-up: first-touch page faults, thread pools, caches
  std::vector<double> ms;
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
  }
  return median_of(std::move(ms));
}

double median_of(std::vector<double> samples) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const std::size_t n = samples.size();
  return n % 2 ? samples[n / 2] : (samples[n / 2 - 1] + samples[n / 2]) / 2;
}

std::vector<double> interleaved_ms(int repeat, int calls,
                                   const std::vector<std::function<void()>>& fns,
                                   const std::function<void()>& sync) {
  using clock = std::chrono::steady_clock;
  std::vector<std::vector<double>> samples(fns.size());
  for (int round = 0; round <= repeat; ++round)
    for (std::size_t f = 0; f < fns.size(); ++f) {
      const auto t0 = clock::now();
      for (int i = 0; i < calls; ++i) fns[f]();
      if (sync) sync();
      const double ms =
          std::chrono::duration<double, std::milli>(clock::now() - t0).count() / calls;
      if (round > 0) samples[f].push_back(ms);
    }
  std::vector<double> out;
  for (auto& v : samples) out.push_back(median_of(std::move(v)));
  return out;
}

BenchRow unavailable_row(const std::string& name, const std::string& why) {
  BenchRow row{name};
  row.unavailable = why.empty() ? "unavailable" : why;
  return row;
}

void print_rows(std::ostream& out, const std::vector<BenchRow>& rows, bool json) {
  const bool counted = std::any_of(rows.begin(), rows.end(),
                                   [](const BenchRow& r) { return r.host_syncs_per_step >= 0; });
  if (json) {
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (const auto& r : rows)
      if (r.unavailable.empty()) {
        nlohmann::ordered_json row = {
            {"name", r.name}, {"ms", r.ms}, {"floor_ms", r.floor_ms}, {"ratio", r.ratio()}};
        if (r.host_syncs_per_step >= 0) {
          row["host_syncs_per_step"] = r.host_syncs_per_step;
          row["copies_per_step"] = r.copies_per_step;
        }
        if (!r.unit.empty()) row["unit"] = r.unit;
        list.push_back(row);
      } else {
        // A row measured without its floor (the peer missing) keeps its value.
        list.push_back({{"name", r.name},
                        {"ms", r.ms > 0 ? nlohmann::ordered_json(r.ms) : nullptr},
                        {"floor_ms", nullptr},
                        {"ratio", nullptr},
                        {"unavailable", r.unavailable}});
        if (r.ms > 0 && !r.unit.empty()) list.back()["unit"] = r.unit;
      }
    out << list.dump(2) << "\n";
    return;
  }
  std::size_t w = 4;
  for (const auto& r : rows) w = std::max(w, r.name.size());
  char buf[128];
  std::snprintf(buf, sizeof buf, "%-*s  %10s  %10s  %7s", int(w), "name", "ms", "floor_ms",
                "ratio");
  out << buf << (counted ? "    syncs   copies\n" : "\n");
  for (const auto& r : rows) {
    if (!r.unavailable.empty()) {
      if (r.ms > 0) {
        std::snprintf(buf, sizeof buf, "%-*s  %10.3f  ", int(w), r.name.c_str(), r.ms);
        out << buf << (r.unit.empty() ? "" : "(" + r.unit + ") ") << "no floor: " << r.unavailable
            << "\n";
        continue;
      }
      std::snprintf(buf, sizeof buf, "%-*s  ", int(w), r.name.c_str());
      out << buf << "unavailable: " << r.unavailable << "\n";
      continue;
    }
    std::snprintf(buf, sizeof buf, "%-*s  %10.3f  %10.3f  %7.2f", int(w), r.name.c_str(), r.ms,
                  r.floor_ms, r.ratio());
    out << buf;
    if (r.host_syncs_per_step >= 0) {
      std::snprintf(buf, sizeof buf, "  %7.2f  %7.2f", r.host_syncs_per_step, r.copies_per_step);
      out << buf;
    }
    if (!r.unit.empty()) out << "  (" << r.unit << ", not ms)";
    out << "\n";
  }
}

void parallel_memcpy(uint8_t* dst, const uint8_t* src, int64_t bytes) {
  constexpr int64_t kBlock = int64_t(1) << 16;
  cpu::parallel_for(0, (bytes + kBlock - 1) / kBlock, 4, [&](int64_t lo, int64_t hi) {
    const int64_t begin = lo * kBlock;
    const int64_t end = std::min(bytes, hi * kBlock);
    std::memcpy(dst + begin, src + begin, static_cast<std::size_t>(end - begin));
  });
}

}  // namespace quanta::cli
