#include "train/run_folder.h"

#include <unistd.h>

#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace quanta::train {
namespace fs = std::filesystem;
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// `quanta_name`, else `torch_name`, as a count >= 0; 0 when neither is set.
int64_t env_count(const char* quanta_name, const char* torch_name) {
  const char* name = env(quanta_name) ? quanta_name : torch_name;
  const char* v = env(name);
  if (!v) return 0;
  const std::string s = v;
  int64_t n = -1;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
  if (ec != std::errc() || end != s.data() + s.size() || n < 0)
    throw std::invalid_argument(std::string(name) + "='" + s +
                                "' is not a restart count: expected a number >= 0");
  return n;
}

}  // namespace

void refuse_to_replace_run(const std::string& dir, const std::vector<std::string>& files,
                           const std::string& ways_on) {
  std::string found;
  std::error_code ec;
  for (const std::string& f : files)
    if (fs::exists(fs::path(dir) / f, ec)) found += (found.empty() ? "" : ", ") + f;
  if (!found.empty())
    throw std::invalid_argument("--out " + dir + " already holds a run (" + found +
                                "): " + ways_on);
}

LaunchRestarts launch_restarts_from_env() {
  LaunchRestarts r;
  r.count = env_count("QUANTA_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT");
  r.max = env_count("QUANTA_MAX_RESTARTS", "TORCHELASTIC_MAX_RESTARTS");
  if (const char* id = env("QUANTA_RUN_ID")) {
    r.run_id = id;
  } else if (const char* torch_id = env("TORCHELASTIC_RUN_ID")) {
    // torchrun's default when --rdzv-id is not given: shared by every job,
    // so it cannot tell this job's run from another's.
    if (std::string(torch_id) != "none") r.run_id = torch_id;
  }
  return r;
}

void claim_run(const std::string& dir, const std::string& run_id) {
  if (run_id.empty()) return;
  fs::create_directories(dir);
  // Written whole, then renamed: a restart never reads half an id.
  const fs::path final_path = fs::path(dir) / kRunIdFile;
  fs::path tmp = final_path;
  tmp += ".";
  tmp += std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << run_id << "\n";
    if (!out) throw std::runtime_error("cannot write " + tmp.string());
  }
  fs::rename(tmp, final_path);
}

RestartPlan restart_plan(const std::string& dir, const LaunchRestarts& restarts,
                         const std::string& checkpoint) {
  if (restarts.count == 0 || restarts.run_id.empty()) return RestartPlan::first_start;
  std::ifstream in(fs::path(dir) / kRunIdFile);
  std::string claimed;
  std::getline(in, claimed);
  if (claimed != restarts.run_id) return RestartPlan::first_start;
  std::error_code ec;
  if (!checkpoint.empty() && fs::exists(fs::path(dir) / checkpoint, ec)) return RestartPlan::resume;
  return RestartPlan::start_again;
}

std::string restart_text(const LaunchRestarts& restarts) {
  std::string s = "restart ";
  s += std::to_string(restarts.count);
  if (restarts.max > 0) {
    s += " of ";
    s += std::to_string(restarts.max);
  }
  return s;
}

}  // namespace quanta::train
