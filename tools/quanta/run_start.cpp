// RunStart: the --out policy quanta train and quanta finetune share.
#include "run_start.h"

#include <filesystem>
#include <iostream>
#include <stdexcept>
#include <utility>

#include "commands.h"
#include "dist_timeout.h"
#include "engine/io/safetensors.h"
#include "relaunch.h"
#include "train/checkpoint.h"
#include "train/outputs.h"

namespace quanta::cli {
namespace {

// How a refused run can go on (train::refuse_to_replace_run).
constexpr const char* kWaysOn = "continue it with --resume, or replace it with --overwrite";

// The step, epoch and config in a checkpoint's header; step -1 when it
// cannot be read (loading it then names the problem).
struct CheckpointHead {
  int64_t step = -1, epoch = -1;
  nlohmann::json config;
};

CheckpointHead read_head(const std::string& path) {
  CheckpointHead h;
  try {
    const auto meta = io::read_safetensors_header(path).metadata;
    h.step = std::stoll(meta.at("step"));
    h.epoch = std::stoll(meta.at("epoch"));
    h.config = nlohmann::json::parse(meta.at("config"));
  } catch (const std::exception&) {
    h.step = -1;
  }
  return h;
}

}  // namespace

RunStart::RunStart(RunRequest request) : r_(std::move(request)) {
  if (r_.resume && !r_.out_given)
    throw UsageError("--resume needs --out DIR, the folder of the run to continue");
  if (r_.resume && r_.overwrite)
    throw UsageError("--resume continues the run in --out, --overwrite replaces it: give one");
  // An input kept in --out under one of the names a run writes there would
  // be replaced by the run's own file.
  if (!r_.dry)
    for (const std::string& file : r_.files)
      refuse_output_over_input("--out", train::out_file(r_.out, file.c_str()), r_.inputs);
  try {
    restarts_ = train::launch_restarts_from_env();
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  resume_ = r_.resume;
  if (r_.dry) return;
  // A restart finds the run it continues through --out; a folder the
  // command names after each start's time would not be found again.
  if (restarts_.max > 0 && !r_.out_given)
    throw UsageError(
        "--out: started with restarts (--max-restarts), this run must be in a folder a "
        "restart can find: give --out DIR");
  try {
    plan_ = train::restart_plan(r_.out, restarts_, train::kCheckpointFile);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  resume_ = r_.resume || plan_ == train::RestartPlan::resume;
}

bool RunStart::finished() {
  if (r_.dry) return false;
  // Before --nproc starts the ranks (and, under a launcher, by every rank
  // before the process group forms, so before rank 0 writes a file).
  try {
    if (!r_.resume && !r_.overwrite && plan_ == train::RestartPlan::first_start)
      train::refuse_to_replace_run(r_.out, r_.files, kWaysOn);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  const bool lead = is_rank_zero();
  const std::string restart = train::restart_text(restarts_);
  if (plan_ == train::RestartPlan::start_again) {
    if (lead)
      std::cout << restart << ": " << r_.out << " holds no checkpoint of this run yet; "
                << r_.gerund << " again from step 0\n";
    return false;
  }
  if (plan_ != train::RestartPlan::resume) return false;
  const CheckpointHead head = read_head(train::out_file(r_.out, train::kCheckpointFile));
  const bool complete = head.step >= 0 && r_.complete(head.step, head.epoch, head.config);
  if (complete && !r_.done_marker.empty() &&
      !std::filesystem::exists(std::filesystem::path(r_.out) / r_.done_marker)) {
    // The outputs come after the last checkpoint: a complete run whose
    // outputs were not written yet runs again.
    resume_ = false;
    if (lead)
      std::cout << restart << ": the run in " << r_.out << " has no " << r_.done_marker << " yet; "
                << r_.gerund << " again from the start\n";
    return false;
  }
  if (complete) {
    if (lead)
      std::cout << restart << ": the run in " << r_.out
                << " is complete (its checkpoint is at its last step, " << head.step
                << "); nothing left to " << r_.verb << "\n";
    return true;
  }
  if (lead)
    std::cout << restart << ": resuming the run in " << r_.out << " from its checkpoint (step "
              << head.step << ")\n";
  return false;
}

train::RunFolderLock RunStart::take(int64_t nproc, const std::string& dist_timeout) {
  apply_dist_timeout(dist_timeout);
  if (nproc > 1 && !under_launcher()) relaunch_with_ranks(static_cast<int>(nproc));
  if (!is_rank_zero()) return {};
  try {
    return train::take_run_folder(
        r_.out, !r_.resume && !r_.overwrite && plan_ == train::RestartPlan::first_start, r_.files,
        kWaysOn, restarts_.max > 0 ? restarts_.run_id : "");
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

}  // namespace quanta::cli
