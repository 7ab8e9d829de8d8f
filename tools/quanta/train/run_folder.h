#pragma once
// The output folder of a run: a folder that already holds one is not
// replaced silently (its checkpoint overwritten, metrics.jsonl truncated),
// except by a restart of the launcher job that wrote it (quanta launch
// --max-restarts, torchrun --max-restarts), which continues that run; and
// one run writes in a folder at a time (its lead process holds the folder's
// lock while it runs).
#include <cstdint>
#include <string>
#include <vector>

namespace quanta::train {

/** Throws std::invalid_argument when `dir` holds any of `files` (what an
 * earlier run left there): one line naming the folder, the files found and
 * `ways_on`, how the user can go on ("continue it with --resume, or replace
 * it with --overwrite"). A missing or empty folder passes. */
void refuse_to_replace_run(const std::string& dir, const std::vector<std::string>& files,
                           const std::string& ways_on);

/** Where a launcher's restarts stand for this process. */
struct LaunchRestarts {
  /** 0: the first attempt (or no launcher); k: the k-th restart. */
  int64_t count = 0;
  /** How many restarts the launcher allows (0: none). */
  int64_t max = 0;
  /** The launcher job's id, the same in every attempt; empty: none. */
  std::string run_id{};
};

/** Reads QUANTA_RESTART_COUNT, QUANTA_MAX_RESTARTS and QUANTA_RUN_ID (quanta
 * launch), else torchrun's TORCHELASTIC_* (its default run id "none" counts
 * as none). Throws std::invalid_argument naming a count that is not a
 * number >= 0. */
LaunchRestarts launch_restarts_from_env();

/** The file in a run folder that names the launcher job writing it. */
inline constexpr const char* kRunIdFile = ".quanta-run-id";

/** Records in `dir` (created if absent) that launcher job `run_id` writes
 * there, so its restarts can tell their own run from one they find; does
 * nothing when `run_id` is empty. */
void claim_run(const std::string& dir, const std::string& run_id);

/** The file in a run folder whose lock (flock) the running lead holds; it
 * names that process ("pid 1234 on host h") for a run that is refused. */
inline constexpr const char* kLockFile = ".quanta-lock";

/** The lock of a run folder, held until destroyed (or the process ends, so a
 * lock left by a process that died is free again). */
class RunFolderLock {
 public:
  RunFolderLock() = default;
  explicit RunFolderLock(int fd) : fd_(fd) {}
  RunFolderLock(RunFolderLock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  RunFolderLock& operator=(RunFolderLock&& o) noexcept;
  RunFolderLock(const RunFolderLock&) = delete;
  RunFolderLock& operator=(const RunFolderLock&) = delete;
  ~RunFolderLock();
  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

/** Takes the lock of `dir` (created if absent) without waiting; throws
 * std::invalid_argument naming the process that holds it ("--out E is in use
 * by another quanta run (pid 1234 on host h): ..."). On a file system that
 * has no locks it warns once on stderr and returns an empty lock. */
RunFolderLock lock_run_folder(const std::string& dir);

/** What the lead process of a run does before it writes into `dir`: takes
 * its lock, checks `files` again under it when `refuse` (another run may have
 * written them since the first check, refuse_to_replace_run's rules and
 * message), then records launcher job `run_id` (claim_run). */
RunFolderLock take_run_folder(const std::string& dir, bool refuse,
                              const std::vector<std::string>& files, const std::string& ways_on,
                              const std::string& run_id);

/** What a command does with its output folder. */
enum class RestartPlan {
  first_start,  // not a restart of the job that claimed the folder: the usual rules
  resume,       // a restart, and the job's checkpoint is there: continue from it
  start_again,  // a restart, and no checkpoint yet: start over, replacing what is there
};

/** The plan for `dir` under `restarts`: resume when this is a restart
 * (count > 0) of the job that claimed `dir` and `dir` holds `checkpoint`
 * (empty: the command keeps none), start_again when it is such a restart
 * without one, first_start otherwise. */
RestartPlan restart_plan(const std::string& dir, const LaunchRestarts& restarts,
                         const std::string& checkpoint);

/** "restart 2 of 3" for the lines a restarted command prints. */
std::string restart_text(const LaunchRestarts& restarts);

}  // namespace quanta::train
