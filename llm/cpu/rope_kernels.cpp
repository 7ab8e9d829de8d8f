// The CPU's rotary embedding: every (row, head) rotated by its row's angles.
#include <algorithm>

#include "engine/cpu/parallel.h"
#include "llm/cpu/kernels.h"
#include "llm/kernels/functors.h"

namespace quanta::llm::llm_cpu {

void rope(DType dtype, bool inverse, const void* x_, const void* cos_, const void* sin_,
          int64_t rows, int64_t table_rows, int64_t heads, int64_t dim, void* out_) {
  dispatch_llm(dtype, "rope", [&](auto types) {
    using T = typename decltype(types)::data;
    using A = typename decltype(types)::acc;
    const T* x = static_cast<const T*>(x_);
    const A* cos = static_cast<const A*>(cos_);
    const A* sin = static_cast<const A*>(sin_);
    T* out = static_cast<T*>(out_);
    const int64_t half = dim / 2;
    const int64_t lines = rows * heads;
    const int64_t grain = std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(dim, 1));
    cpu::parallel_for(0, lines, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t line = lo; line < hi; ++line) {
        const int64_t r = line / heads % table_rows;
        const A* c = cos + r * half;
        const A* s = sin + r * half;
        const T* xl = x + line * dim;
        T* ol = out + line * dim;
        for (int64_t d = 0; d < half; ++d)
          fn::rope_pair<T, A>(xl[d], xl[d + half], c[d], inverse ? -s[d] : s[d], ol + d,
                              ol + d + half);
      }
    });
  });
}

}  // namespace quanta::llm::llm_cpu
