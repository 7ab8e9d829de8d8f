#pragma once
// --profile and --profile-timing of quanta train and quanta finetune: the
// kernel-table calls of some steps counted and timed per entry
// (engine/profile/call_profile.h, train/loop.h's ProfileSettings), printed
// after them and kept in metrics.jsonl as a "profile" record.
#include <CLI/CLI.hpp>
#include <string>

#include "train/loop.h"

namespace quanta::cli {

struct ProfileFlags {
  int64_t steps = 0;
  std::string timing = "host";
  std::string trace;
  /** The loop's settings from the flags. */
  train::ProfileSettings settings() const;
};

/** Adds both flags to `sub`, stored in `f`. */
void add_profile_flags(CLI::App& sub, ProfileFlags& f);

}  // namespace quanta::cli
