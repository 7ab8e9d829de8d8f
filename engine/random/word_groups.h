#pragma once
// The CPU's parallel walk over a stream's word groups (engine/random/draw.h
// explains groups): samplers and the CPU table's random_fill share it.
#include <algorithm>
#include <cstdint>

#include "engine/cpu/parallel.h"
#include "engine/random/generator.h"

namespace quanta::cpu {

/** Calls f(g, words) for groups g in [0, groups), group g owning words
 * [g * W, (g + 1) * W) of `s`. Words are computed chunk by chunk on the stack. */
template <int W, class F>
void for_groups(const PhiloxStream& s, int64_t groups, F&& f) {
  constexpr int64_t kChunk = 512;
  parallel_for(0, groups, kGrainElements / 4, [&](int64_t lo, int64_t hi) {
    uint32_t buf[kChunk * W];
    for (int64_t c = lo; c < hi; c += kChunk) {
      const int64_t m = std::min(kChunk, hi - c);
      s.words(c * W, (c + m) * W, buf);
      for (int64_t k = 0; k < m; ++k) f(c + k, buf + k * W);
    }
  });
}

}  // namespace quanta::cpu
