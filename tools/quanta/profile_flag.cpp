#include "profile_flag.h"

#include "flag_checks.h"
#include "train/limits.h"

namespace quanta::cli {

train::ProfileSettings ProfileFlags::settings() const {
  return {.steps = steps,
          .timing = timing == "device" ? CallTiming::device : CallTiming::host,
          .trace_path = trace};
}

void add_profile_flags(CLI::App& sub, ProfileFlags& f) {
  sub.add_option("--profile", f.steps,
                 "count and time every kernel call of this many steps (after the run's first "
                 "two, or a shorter run's last ones), per kernel-table entry, and print where "
                 "the steps' time went; kept in metrics.jsonl as a \"profile\" record. The "
                 "steps run as called, not as a graph (the same results)")
      ->transform(integer_in(1, train::kMaxSteps));
  sub.add_option("--profile-timing", f.timing,
                 "host: each call's time on the calling thread (on a GPU, what launching it "
                 "costs the host); device: the device synchronised after each call, so that "
                 "its time holds the kernel's too (each kernel then runs alone)")
      ->capture_default_str()
      ->check(CLI::IsMember({"host", "device"}))
      ->needs("--profile");
  sub.add_option("--profile-trace", f.trace,
                 "also write the profiled steps' calls as a timeline to this file, in Chrome's "
                 "trace format (open it in ui.perfetto.dev or chrome://tracing): each call on "
                 "the thread that made it, each step's span beside them")
      ->needs("--profile");
}

}  // namespace quanta::cli
