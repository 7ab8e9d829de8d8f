// random_fill on the CPU: the stream's word groups in parallel, each mapped
// by the shared rule (engine/random/draw.h) that the CUDA entry runs too.
#include "engine/cpu/kernels.h"
#include "engine/dispatch.h"
#include "engine/random/draw.h"
#include "engine/random/word_groups.h"

namespace quanta::cpu {
namespace {

template <int W, class T>
void fill_groups(const RandomFill& f, int64_t n, int64_t groups, T* out) {
  const PhiloxStream s{{f.key[0], f.key[1]}, {f.start_lo, f.start_hi}};
  for_groups<W>(s, groups,
                [&](int64_t g, const uint32_t* w) { draw::fill_group<W>(f, n, g, w, out); });
}

template <class T>
void fill_typed(const RandomFill& f, const draw::Grouping& gr, int64_t n, void* out) {
  T* p = static_cast<T*>(out);
  const int64_t groups = draw::groups(gr, n);
  switch (gr.words) {
    case 1:
      return fill_groups<1>(f, n, groups, p);
    case 2:
      return fill_groups<2>(f, n, groups, p);
    default:
      return fill_groups<4>(f, n, groups, p);
  }
}

}  // namespace

void random_fill(const RandomFill& f, int64_t n, void* out) {
  const draw::Grouping gr = draw::grouping(f.draw, f.dtype);
  if (n == 0) return;
  switch (f.dtype) {
    case DType::f32:
      return fill_typed<float>(f, gr, n, out);
    case DType::f64:
      return fill_typed<double>(f, gr, n, out);
    case DType::bf16:
      return fill_typed<bf16>(f, gr, n, out);
    case DType::f16:
      return fill_typed<f16>(f, gr, n, out);
    default:
      return fill_typed<int64_t>(f, gr, n, out);
  }
}

}  // namespace quanta::cpu
