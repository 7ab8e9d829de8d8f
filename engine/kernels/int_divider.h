#pragma once
// Division by a run-time constant as a multiply and a shift (Granlund and
// Montgomery; Hacker's Delight, 10-9): what a kernel walking strided
// operands does for every dim of every element, where a GPU's 64-bit integer
// division costs dozens of instructions. QUANTA_HD, so the CPU tests check
// the very arithmetic a CUDA thread runs.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "engine/kernels/functors.h"  // QUANTA_HD

namespace quanta {

/** Divides unsigned 32-bit dividends below 2^31 by a divisor in [1, 2^31]. */
struct IntDivider {
  uint32_t divisor = 1;
  uint32_t magic = 1;  // floor(2^32 (2^shift - divisor) / divisor) + 1
  uint32_t shift = 0;  // ceil(log2(divisor))

  IntDivider() = default;
  explicit IntDivider(uint32_t d) : divisor(d) {
    if (d < 1 || d > (uint32_t(1) << 31))
      throw std::invalid_argument("[IntDivider] divisor " + std::to_string(d) +
                                  " outside [1, 2^31]");
    shift = 0;
    while ((uint64_t(1) << shift) < d) ++shift;
    magic = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }

  /** n / divisor for n < 2^31 (then t + n below cannot overflow). */
  QUANTA_HD uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t t = __umulhi(n, magic);
#else
    const auto t = static_cast<uint32_t>((static_cast<uint64_t>(n) * magic) >> 32);
#endif
    return (t + n) >> shift;
  }
};

}  // namespace quanta
