#pragma once
// Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as
// easy as 1, 2, 3", SC'11; the Random123 library). A bijection of a 128-bit
// counter under a 64-bit key: the same (counter, key) gives the same four
// words everywhere. Only 32x32->64 multiplies, xors and adds, so a CUDA
// version written the same way gives identical bits.
#include <array>
#include <cstdint>

// QUANTA_HD as engine/kernels/functors.h defines it (the same tokens, so
// either header may come first). Not that header itself: quanta.h includes
// this one, and quanta::fn would then clash with quanta::dist::fn.
#if defined(__CUDACC__)
#define QUANTA_HD __host__ __device__
#else
#define QUANTA_HD
#endif

namespace quanta {

namespace detail {
inline constexpr uint32_t kPhiloxM0 = 0xD2511F53u;  // round multipliers
inline constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
inline constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;  // key schedule (golden ratio)
inline constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;  // key schedule (sqrt(3) - 1)

QUANTA_HD constexpr std::array<uint32_t, 4> philox_round(const std::array<uint32_t, 4>& c,
                                                         const std::array<uint32_t, 2>& k) {
  const uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * c[0];
  const uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * c[2];
  const auto hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
  const auto hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
  return {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
}
}  // namespace detail

/** The four output words of Philox4x32 with 10 rounds for `counter` under
 * `key` (matches the Random123 known-answer vectors). Host and device. */
QUANTA_HD constexpr std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter,
                                                          std::array<uint32_t, 2> key) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key[0] += detail::kPhiloxW0;  // unsigned: wraps mod 2^32 by definition
      key[1] += detail::kPhiloxW1;
    }
    counter = detail::philox_round(counter, key);
  }
  return counter;
}

/** The 128-bit counter (start_hi:start_lo) + block, mod 2^128, as the four
 * 32-bit words philox4x32_10 takes (low word first). */
QUANTA_HD constexpr std::array<uint32_t, 4> philox_counter(uint64_t start_lo, uint64_t start_hi,
                                                           uint64_t block) {
  const uint64_t lo = start_lo + block;
  const uint64_t hi = start_hi + (lo < block ? 1 : 0);
  return {static_cast<uint32_t>(lo), static_cast<uint32_t>(lo >> 32), static_cast<uint32_t>(hi),
          static_cast<uint32_t>(hi >> 32)};
}

}  // namespace quanta
