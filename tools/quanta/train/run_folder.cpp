#include "train/run_folder.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "train/outputs.h"

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

// A metrics file counts as a run once it holds a record other than a
// start's header: a run that failed before its first step leaves only its
// header, and the corrected command must not need --overwrite for that.
// A line that is not JSON counts (the file is not ours to replace).
bool holds_records(const fs::path& metrics) {
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const nlohmann::json r = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!r.is_object() || r.value("kind", "") != "header") return true;
  }
  return false;
}

}  // namespace

void refuse_to_replace_run(const std::string& dir, const std::vector<std::string>& files,
                           const std::string& ways_on) {
  std::string found;
  std::error_code ec;
  for (const std::string& f : files) {
    const fs::path path = fs::path(dir) / f;
    if (!fs::exists(path, ec)) continue;
    if (f == kMetricsFile && !holds_records(path)) continue;
    found += (found.empty() ? "" : ", ") + f;
  }
  if (!found.empty())
    throw std::invalid_argument("--out " + dir + " already holds a run (" + found +
                                "): " + ways_on);
}

RunFolderLock& RunFolderLock::operator=(RunFolderLock&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

RunFolderLock::~RunFolderLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the flock
}

RunFolderLock lock_run_folder(const std::string& dir) {
  fs::create_directories(dir);
  const std::string path = (fs::path(dir) / kLockFile).string();
  // Not inherited by a program exec'd later (quanta launch's ranks take
  // their own locks where they write).
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0)
    throw std::runtime_error("cannot open " + path + ": " + std::string(std::strerror(errno)));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err != EWOULDBLOCK) {
      ::close(fd);
      std::cerr << "quanta: warning: cannot lock " << path << " (" << std::strerror(err)
                << "); nothing stops a second run from writing in " << dir << "\n";
      return {};
    }
    char buf[256] = {};
    const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
    ::close(fd);
    std::string holder = n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : "";
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    throw std::invalid_argument(
        "--out " + dir + " is in use by another quanta run (" +
        (holder.empty() ? std::string("a process that is starting") : holder) +
        "): wait for it to end, or give another --out");
  }
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "unknown");
  const std::string me =
      "pid " + std::to_string(::getpid()) + " on host " + std::string(host) + "\n";
  const bool noted = ::ftruncate(fd, 0) == 0 &&
                     ::pwrite(fd, me.data(), me.size(), 0) == static_cast<ssize_t>(me.size());
  (void)noted;  // without its note the lock still holds; a refused run names no process
  return RunFolderLock(fd);
}

RunFolderLock take_run_folder(const std::string& dir, bool refuse,
                              const std::vector<std::string>& files, const std::string& ways_on,
                              const std::string& run_id) {
  RunFolderLock lock = lock_run_folder(dir);
  if (refuse) refuse_to_replace_run(dir, files, ways_on);
  claim_run(dir, run_id);
  return lock;
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
