#include "dist_timeout.h"

#include <chrono>
#include <cstdlib>
#include <stdexcept>

#include "dist/process_group.h"
#include "flag_checks.h"
#include "train/limits.h"

namespace quanta::cli {

CLI::Option* add_dist_timeout_flag(CLI::App& sub, std::string& seconds) {
  // The default shown is dist's own (GroupOptions), what an unset flag leaves.
  const auto dist_default =
      std::chrono::duration_cast<std::chrono::seconds>(dist::GroupOptions{}.timeout);
  return sub
      .add_option("--dist-timeout", seconds,
                  "seconds the ranks may wait for each other (rendezvous, collectives) "
                  "before failing; sets QUANTA_DIST_TIMEOUT for every rank")
      ->type_name("SECONDS")
      ->default_str(std::to_string(dist_default.count()))
      ->check(number_in(0, double(train::kMaxDistTimeout), true));
}

void apply_dist_timeout(const std::string& seconds) {
  if (seconds.empty()) return;
  if (::setenv(kDistTimeoutEnv, seconds.c_str(), 1) != 0)
    throw std::runtime_error(std::string("--dist-timeout: cannot set ") + kDistTimeoutEnv);
}

}  // namespace quanta::cli
