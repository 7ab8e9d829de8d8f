#pragma once
// Launch geometry for grid-stride kernels, computed on the host. Plain C++ so
// the CPU tests check it; the CUDA kernels and this header agree on
// kThreadsPerBlock.
#include <algorithm>
#include <cstdint>

namespace quanta::cuda {

inline constexpr int kThreadsPerBlock = 256;

struct LaunchConfig {
  int64_t blocks = 0;  // 0: nothing to launch
  int threads = kThreadsPerBlock;
};

/** Blocks for `n` elements of a grid-stride loop: enough to cover n, at most
 * `max_blocks` (a few waves of the device's multiprocessors: more only adds
 * scheduling work, each thread loops over the rest). 0 blocks for n <= 0. */
inline LaunchConfig launch_config(int64_t n, int64_t max_blocks) {
  LaunchConfig c;
  if (n <= 0) return c;
  const int64_t needed = (n + kThreadsPerBlock - 1) / kThreadsPerBlock;
  c.blocks = std::max<int64_t>(1, std::min(needed, max_blocks));
  return c;
}

/** How a grid reduction's thread-per-output kernel cuts the reduced length a
 * of `outputs` outputs: `pieces` pieces of `piece` (the last may be shorter),
 * folded by separate threads and combined in order by a second pass. Cut only
 * when the outputs alone leave the device mostly idle (under kBusyThreads
 * threads), and never into pieces under kMinPiece, whose partial results
 * would cost more than they save. */
struct GridPieces {
  int64_t piece = 0;
  int64_t pieces = 1;
};
inline constexpr int64_t kBusyThreads = int64_t(1) << 16;
inline constexpr int64_t kMinPiece = 32;

inline GridPieces grid_pieces(int64_t outputs, int64_t a) {
  GridPieces g{std::max<int64_t>(a, 0), 1};
  if (outputs <= 0 || outputs >= kBusyThreads || a < 2 * kMinPiece) return g;
  const int64_t want = std::min((kBusyThreads + outputs - 1) / outputs, a / kMinPiece);
  g.piece = (a + want - 1) / want;
  g.pieces = (a + g.piece - 1) / g.piece;
  return g;
}

/** Lanes of a warp that share one row of d values in a row reduction (1, 8
 * or 32): a warp's loads then read neighbouring values of its rows together
 * (coalesced) instead of one value from each of 32 rows d apart, and short
 * rows do not leave most lanes idle. */
inline int row_lanes(int64_t d) { return d >= 32 ? 32 : d >= 8 ? 8 : 1; }

}  // namespace quanta::cuda
