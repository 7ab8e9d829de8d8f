#pragma once
// How a training command's run begins with its --out folder: one policy for
// quanta train (both tasks) and quanta finetune (both kinds). In order:
//   RunStart start(request);  reads the launcher's restarts, checks --resume,
//                             --overwrite and --out against the inputs, and
//                             plans: first start, resume, or start again
//   start.resume()            whether the run continues from its checkpoint
//                             (the command then checks its settings against it)
//   start.finished()          refuses a folder that holds another run; says
//                             what a restart does; true: nothing left to do
//   start.take(nproc, t)      --dist-timeout, --nproc (runs again as N ranks
//                             under quanta launch), and rank 0 takes the folder
// Every refusal is a UsageError naming the folder and how to go on.
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "flag_checks.h"
#include "train/run_folder.h"

namespace quanta::cli {

/** What a command asks of its --out folder. */
struct RunRequest {
  /** The folder, as given (empty: the command picks one; see out_given). */
  std::string out{};
  /** Whether --out was given: a job with restarts must name its folder. */
  bool out_given = true;
  /** --resume and --overwrite. */
  bool resume = false, overwrite = false;
  /** --print-config: the folder is neither planned nor refused. */
  bool dry = false;
  /** What a run writes in --out: a folder holding any is another run. */
  std::vector<std::string> files{};
  /** Inputs that no output may replace. */
  std::vector<InputFile> inputs{};
  /** "train", "fine-tune": "nothing left to train", "training again". */
  std::string verb = "train", gerund = "training";
  /** Whether a checkpoint with this step, epoch and config (its header) is
   * at the run's last step. */
  std::function<bool(int64_t step, int64_t epoch, const nlohmann::json& config)> complete{};
  /** A file written after the last checkpoint: a complete checkpoint
   * without it is run again from the start. Empty: complete means done. */
  std::string done_marker{};
};

/** One run's start (see the top of this file). */
class RunStart {
 public:
  /** Throws UsageError: --resume with --overwrite or without --out,
   * restarts without --out, an output over an input, a bad restart count. */
  explicit RunStart(RunRequest request);

  /** Whether the run continues from the checkpoint in --out (--resume, or
   * a launcher's restart that finds its checkpoint there). */
  bool resume() const { return resume_; }

  /** Refuses (UsageError) a folder holding another run unless --resume or
   * --overwrite; on a launcher's restart, says on rank 0 what it does with
   * the run it finds. True when that run is complete. */
  bool finished();

  /** Sets --dist-timeout's variable, replaces a process started by hand
   * with `quanta launch -n nproc` when nproc > 1, and on rank 0 takes the
   * folder (its lock, the refusal again under it, the launcher's claim). */
  train::RunFolderLock take(int64_t nproc, const std::string& dist_timeout);

 private:
  RunRequest r_;
  train::LaunchRestarts restarts_;
  train::RestartPlan plan_ = train::RestartPlan::first_start;
  bool resume_ = false;
};

}  // namespace quanta::cli
