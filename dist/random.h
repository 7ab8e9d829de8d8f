#pragma once
// Rank-consistent random streams (DESIGN.md rule 3): randomness that must
// agree across ranks is derived, never communicated. The group's root seed
// is agreed once when the group is made; after that a stream is a pure
// function of (seed, name), so every rank draws the same numbers for the
// same sequence of calls, in train, eval, no-grad and inference alike.
//
// shared_generator(g, name) counts per call (each draw advances it): ranks
// agree as long as each makes the same draws. shared_generator(g, name, step)
// is keyed by an explicit step as well, so it agrees even when one rank made
// extra draws earlier (prefer it for per-step decisions).
#include <cstdint>
#include <string_view>

#include "dist/process_group.h"
#include "engine/random/generator.h"

namespace quanta::dist {

/** The stream `name` under the group's seed: identical on every rank. */
Generator shared_generator(const ProcessGroup& group, std::string_view name);
/** The stream `name` at `step` (its own counter range): identical on every
 * rank, whatever was drawn before. */
Generator shared_generator(const ProcessGroup& group, std::string_view name, uint64_t step);
/** The stream `name` of this rank: different on every rank, reproducible
 * for a given (seed, name, rank). */
Generator rank_generator(const ProcessGroup& group, std::string_view name);

}  // namespace quanta::dist
