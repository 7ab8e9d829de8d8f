#pragma once
// Whether this CPU takes bf16 products natively (engine/cpu/gemm_bf16.h),
// and the one line a test that needs them prints when it does not. Each
// suite with such tests has a meson entry, `forced_test`, that runs them
// with QUANTA_CPU_BF16_GEMM=1 (oneDNN emulates the instructions), so every
// machine with oneDNN checks them.
#include <doctest/doctest.h>

#include <string>

#include "engine/cpu/gemm_bf16.h"

namespace quanta::testing {

/** True where bf16 products are native; else prints why the calling test
 * stops here and which forced meson test runs it, and returns false. */
inline bool bf16_products_or_skip(const std::string& forced_test) {
  if (cpu::bf16_gemm_native()) return true;
  MESSAGE(
      "skipped: bf16 products are not native here (no oneDNN, no bf16 instructions, bf16 "
      "products slower than f32 ones, or QUANTA_CPU_BF16_GEMM=0); the "
      << forced_test << " test runs them emulated");
  return false;
}

}  // namespace quanta::testing
