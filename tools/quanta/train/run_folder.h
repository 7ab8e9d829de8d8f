#pragma once
// The output folder of a run: a folder that already holds one is not
// replaced silently (its checkpoint overwritten, metrics.jsonl truncated).
#include <string>
#include <vector>

namespace quanta::train {

/** Throws std::invalid_argument when `dir` holds any of `files` (what an
 * earlier run left there): one line naming the folder, the files found and
 * `ways_on`, how the user can go on ("continue it with --resume, or replace
 * it with --overwrite"). A missing or empty folder passes. */
void refuse_to_replace_run(const std::string& dir, const std::vector<std::string>& files,
                           const std::string& ways_on);

}  // namespace quanta::train
