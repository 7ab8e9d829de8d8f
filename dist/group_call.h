#pragma once
// One collective call in flight: its fingerprint, tag and deadline, and the
// guard that turns a backend's failure into the group's report. Internal to
// dist.
#include <chrono>
#include <stdexcept>
#include <string>

#include "dist/fingerprint.h"
#include "dist/process_group.h"
#include "engine/profile/timed_table.h"
#include "engine/random/generator.h"

namespace quanta::dist {

struct ProcessGroup::Call {
  detail::Fingerprint fp;
  uint32_t tag = 0;
  uint32_t word = 0;  // check_word(fp): what the always-on check carries
  Millis timeout{0};
  std::chrono::steady_clock::time_point start;
  /** The call's row of a CallProfile ("dist.all_reduce"), while one lives:
   * from begin() to the end of the collective. */
  profile::SideCall profiled;
  /** "all_reduce #3 (f32 [4], sum) at x.cpp:12", built only for messages
   * (formatting it costs more than a small collective's bookkeeping). */
  std::string desc() const { return detail::describe(fp); }
};

namespace detail {
/** A tag of its own for a call's k-th extra message (the always-on check's
 * ring, all_gather_v's sizes): distinct from the call's tag and the others'. */
inline uint32_t sub_tag(uint32_t tag, uint32_t k) {
  return static_cast<uint32_t>(quanta::detail::splitmix64((uint64_t(tag) << 8) | k));
}
}  // namespace detail

// Runs a backend call, turning its failures into fail()'s report.
template <class F>
void ProcessGroup::guarded(const Call& call, F&& f) {
  try {
    f();
  } catch (const DistError&) {
    throw;
  } catch (const std::invalid_argument&) {
    throw;
  } catch (const std::exception& e) {
    fail(call, e.what());
  }
}

}  // namespace quanta::dist
