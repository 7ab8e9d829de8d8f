#pragma once
// --dist-timeout SECONDS of quanta train, finetune and launch. The library
// reads QUANTA_DIST_TIMEOUT when a process group forms (dist/); the flag sets
// that variable in this process, before any group exists, so ranks started
// from here (quanta launch, --nproc N) inherit it.
#include <CLI/CLI.hpp>
#include <string>

namespace quanta::cli {

/** The environment variable the flag sets. */
inline constexpr const char* kDistTimeoutEnv = "QUANTA_DIST_TIMEOUT";

/** Adds --dist-timeout SECONDS (a number > 0, at most a week; 2.5 is fine)
 * to `sub`, its text stored in `seconds`; returns the option. */
CLI::Option* add_dist_timeout_flag(CLI::App& sub, std::string& seconds);

/** Sets QUANTA_DIST_TIMEOUT to `seconds` unless it is empty (a flag not
 * given leaves the environment as it is). */
void apply_dist_timeout(const std::string& seconds);

}  // namespace quanta::cli
