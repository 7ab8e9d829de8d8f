#pragma once
// Rank-consistent random streams (docs/design.md rule 3): randomness that must
// agree across ranks is derived, never communicated. The group's root seed
// is agreed once when the group is made; after that a stream is a pure
// function of (seed, name, which call), so every rank draws the same numbers
// for the same sequence of calls, in train, eval, no-grad and inference alike.
//
// Counted per call: the k-th call of shared_generator(g, name) on a rank
// (k = 0, 1, ...) returns the stream `name` at Philox offset {lo = 0, hi = k},
// so calling it once per step gives new numbers every step, and ranks agree
// as long as each makes the same calls (the count is local: no communication).
// Draws within one call use the low half of the counter, so calls never
// overlap. shared_generator(g, name, step) is keyed by an explicit step
// instead (a nested stream of its own at {0, step}): it agrees even when one
// rank made extra calls or draws earlier, and never meets a counted call's
// numbers. Prefer it for per-step decisions.
#include <cstdint>
#include <string_view>

#include "dist/process_group.h"
#include "engine/random/generator.h"

namespace quanta::dist {

/** The next range of stream `name` under the group's seed (the k-th call
 * gets the k-th range): identical on every rank that made the same calls. */
Generator shared_generator(ProcessGroup& group, std::string_view name);
/** The stream `name` at `step` (its own counter range): identical on every
 * rank, whatever was called or drawn before. */
Generator shared_generator(const ProcessGroup& group, std::string_view name, uint64_t step);
/** The next range of this rank's stream `name` (counted per call like
 * shared_generator): different on every rank, reproducible for a given
 * (seed, name, rank, call). */
Generator rank_generator(ProcessGroup& group, std::string_view name);

}  // namespace quanta::dist
