// random_fill on the CPU: the stream's word groups in parallel, each mapped
// by the shared rule (engine/random/draw.h) that the CUDA entry runs too.
#include <algorithm>

#include "engine/cpu/kernels.h"
#include "engine/dispatch.h"
#include "engine/random/draw.h"
#include "engine/random/word_groups.h"

namespace quanta::cpu {

namespace {

// dst[k] = (src ? src[k] : 1) * (w[k] < cut ? kept : dropped): unaliased
// pointers, so the compiler vectorises the select (through the caller's
// captured values it kept a scalar branch per element, 70% of a dropout).
template <class T>
void select_words(const uint32_t* __restrict w, const T* __restrict src, T* __restrict dst,
                  int64_t m, uint32_t cut, T kept, T dropped) {
  if (src) {
    for (int64_t k = 0; k < m; ++k) dst[k] = src[k] * (w[k] < cut ? kept : dropped);
  } else {
    for (int64_t k = 0; k < m; ++k) dst[k] = w[k] < cut ? kept : dropped;
  }
}

// The same select applied to two sources: dst[k] = src[k] * mask and
// dst2[k] = src2[k] * mask, one compare per word.
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

// A bernoulli fill in f32 or f64 (dropout's masks) as one select per word:
// fill_group's two possible values formed once, so the same bits, in a loop
// the compiler vectorises instead of fill_group's per-element dispatch.
template <class T>
void bernoulli_fill(const RandomFill& f, int64_t n, T* out) {
  const T a = static_cast<T>(f.scale), b = static_cast<T>(f.shift);
  const T one = f.affine ? draw::affine(a, b, T(1)) : T(1);
  const T zero = f.affine ? draw::affine(a, b, T(0)) : T(0);
  const PhiloxStream s{{f.key[0], f.key[1]}, {f.start_lo, f.start_hi}};
  const T* times = static_cast<const T*>(f.times);
  const T* times2 = times ? static_cast<const T*>(f.times2) : nullptr;
  T* out2 = times ? static_cast<T*>(f.out2) : nullptr;
  // word < below as a 32-bit compare, so the select compares 16 words per
  // instruction. below is at most 2^32 (p = 1: every word keeps), which no
  // 32-bit cut expresses: then nothing is below the cut 0 and a dropped
  // value is the kept one.
  const bool all = f.below > 0xFFFFFFFFu;
  const auto cut = static_cast<uint32_t>(all ? 0 : f.below);
  const T dropped = all ? one : zero;
  constexpr int64_t kChunk = 2048;
  parallel_for(0, n, kGrainElements, [&](int64_t lo, int64_t hi) {
    uint32_t words[kChunk];
    for (int64_t c = lo; c < hi; c += kChunk) {
      const int64_t m = std::min(kChunk, hi - c);
      s.words(c, c + m, words);
      if (out2)
        select_words2(words, times + c, times2 + c, out + c, out2 + c, m, cut, one, dropped);
      else
        select_words(words, times ? times + c : nullptr, out + c, m, cut, one, dropped);
    }
  });
}

}  // namespace

void random_fill(const RandomFill& fill, int64_t n, void* out) {
  RandomFill f = fill;
  draw::resolve_stream(f);
  const draw::Grouping gr = draw::grouping(f.draw, f.dtype);
  if (n == 0) return;
  if (f.draw == RandomDraw::bernoulli && f.dtype == DType::f32)
    return bernoulli_fill(f, n, static_cast<float*>(out));
  if (f.draw == RandomDraw::bernoulli && f.dtype == DType::f64)
    return bernoulli_fill(f, n, static_cast<double*>(out));
  draw::dispatch_fill<bf16, f16>(gr, f.dtype, [&]<int W, class T>() {
    const PhiloxStream s{{f.key[0], f.key[1]}, {f.start_lo, f.start_hi}};
    T* p = static_cast<T*>(out);
    for_groups<W>(s, draw::groups(gr, n),
                  [&](int64_t g, const uint32_t* w) { draw::fill_group<W>(f, n, g, w, p); });
  });
}

}  // namespace quanta::cpu
