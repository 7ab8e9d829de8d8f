// random_fill on the CPU: the stream's word groups in parallel, each mapped
// by the shared rule (engine/random/draw.h) that the CUDA entry runs too.
#include "engine/cpu/kernels.h"
#include "engine/dispatch.h"
#include "engine/random/draw.h"
#include "engine/random/word_groups.h"

namespace quanta::cpu {

void random_fill(const RandomFill& f, int64_t n, void* out) {
  const draw::Grouping gr = draw::grouping(f.draw, f.dtype);
  if (n == 0) return;
  draw::dispatch_fill<bf16, f16>(gr, f.dtype, [&]<int W, class T>() {
    const PhiloxStream s{{f.key[0], f.key[1]}, {f.start_lo, f.start_hi}};
    T* p = static_cast<T*>(out);
    for_groups<W>(s, draw::groups(gr, n),
                  [&](int64_t g, const uint32_t* w) { draw::fill_group<W>(f, n, g, w, p); });
  });
}

}  // namespace quanta::cpu
