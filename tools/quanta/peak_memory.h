#pragma once
// The peak resident memory of this process, for the commands that report
// what a job held (generate --json, quantize, bench llm's memory row).
#include <cstdint>

namespace quanta::cli {

/** This process's peak resident memory in bytes since it started its
 * program (VmHWM of /proc/self/status: what a child forked from a large
 * process held before its exec is not counted, as getrusage's maximum
 * would count it), -1 where /proc cannot tell. */
int64_t peak_rss_bytes();

}  // namespace quanta::cli
