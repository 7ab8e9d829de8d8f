#pragma once
// Dropout's keep-mask on the CPU: the words of a bernoulli fill's stream
// compared against its cut, each element then multiplied by the kept value or
// the dropped one. random_fill's bernoulli fill and the dropout product
// (dropout_product.cpp) both apply it, so their masks are the same bits.
#include <cstdint>

#include "engine/kernels/table.h"
#include "engine/random/draw.h"
#include "engine/random/generator.h"

namespace quanta::cpu {

/** Whether the fused dropout_product keeps the mask as bits (its AVX-512
 * build; without AVX-512 f32 takes the unfused steps, which cannot). */
#if defined(__AVX512F__)
inline constexpr bool kDropoutKeepsBits = true;
#else
inline constexpr bool kDropoutKeepsBits = false;
#endif

template <class T>
struct KeepMask {
  PhiloxStream stream;
  uint32_t cut = 0;  // words below it keep
  T kept = 1, dropped = 0;

  /** The mask of bernoulli fill f (f32 or f64). */
  explicit KeepMask(const RandomFill& f) : stream{{f.key[0], f.key[1]}, {f.start_lo, f.start_hi}} {
    const T a = static_cast<T>(f.scale), b = static_cast<T>(f.shift);
    const T one = f.affine ? draw::affine(a, b, T(1)) : T(1);
    const T zero = f.affine ? draw::affine(a, b, T(0)) : T(0);
    // word < below as a 32-bit compare, so the select compares 16 words per
    // instruction. below is at most 2^32 (p = 1: every word keeps), which no
    // 32-bit cut expresses: then nothing is below the cut 0 and a dropped
    // value is the kept one.
    const bool all = f.below > 0xFFFFFFFFu;
    cut = static_cast<uint32_t>(all ? 0 : f.below);
    kept = one;
    dropped = all ? one : zero;
  }
};

/** dst[k] = (src ? src[k] : 1) * (w[k] < cut ? kept : dropped): unaliased
 * pointers, so the compiler vectorises the select (through the caller's
 * captured values it kept a scalar branch per element, 70% of a dropout). */
template <class T>
void select_words(const uint32_t* __restrict w, const T* __restrict src, T* __restrict dst,
                  int64_t m, uint32_t cut, T kept, T dropped) {
  if (src) {
    for (int64_t k = 0; k < m; ++k) dst[k] = src[k] * (w[k] < cut ? kept : dropped);
  } else {
    for (int64_t k = 0; k < m; ++k) dst[k] = w[k] < cut ? kept : dropped;
  }
}

/** The same select applied to two sources: dst[k] = src[k] * mask and
 * dst2[k] = src2[k] * mask, one compare per word. */
template <class T>
void select_words2(const uint32_t* __restrict w, const T* __restrict src, const T* __restrict src2,
                   T* __restrict dst, T* __restrict dst2, int64_t m, uint32_t cut, T kept,
                   T dropped) {
  for (int64_t k = 0; k < m; ++k) {
    const T mask = w[k] < cut ? kept : dropped;
    dst[k] = src[k] * mask;
    dst2[k] = src2[k] * mask;
  }
}

}  // namespace quanta::cpu
