// random_fill on the CPU: the stream's word groups in parallel, each mapped
// by the shared rule (engine/random/draw.h) that the CUDA entry runs too.
#include <algorithm>

#include "engine/cpu/keep_mask.h"
#include "engine/cpu/kernels.h"
#include "engine/dispatch.h"
#include "engine/random/draw.h"
#include "engine/random/word_groups.h"

namespace quanta::cpu {

namespace {

// A bernoulli fill in f32 or f64 (dropout's masks) as one select per word:
// fill_group's two possible values formed once, so the same bits, in a loop
// the compiler vectorises instead of fill_group's per-element dispatch.
template <class T>
void bernoulli_fill(const RandomFill& f, int64_t n, T* out) {
  const KeepMask<T> mask(f);
  const T* times = static_cast<const T*>(f.times);
  const T* times2 = times ? static_cast<const T*>(f.times2) : nullptr;
  T* out2 = times ? static_cast<T*>(f.out2) : nullptr;
  constexpr int64_t kChunk = 2048;
  parallel_for(0, n, kGrainElements, [&](int64_t lo, int64_t hi) {
    uint32_t words[kChunk];
    for (int64_t c = lo; c < hi; c += kChunk) {
      const int64_t m = std::min(kChunk, hi - c);
      mask.stream.words(c, c + m, words);
      if (out2)
        select_words2(words, times + c, times2 + c, out + c, out2 + c, m, mask.cut, mask.kept,
                      mask.dropped);
      else
        select_words(words, times ? times + c : nullptr, out + c, m, mask.cut, mask.kept,
                     mask.dropped);
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
