// The CPU's index family: slices by index, gathers and scatters along one
// dim, index_add. Duplicated indices are applied in order within one thread,
// so results do not depend on the thread count.
#include <algorithm>
#include <array>
#include <type_traits>

#include "engine/cpu/convert.h"
#include "engine/cpu/kernels.h"
#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"

namespace quanta::cpu {
namespace {

// Walks the positions of `shape` one line along `dim` at a time: for every
// combination of the other coordinates, calls line(base) where base[k] is that
// combination's element offset under strides[k]. Distinct lines differ outside
// `dim`, so scatters through them never collide and lines run in parallel;
// within a line the order is sequential, which keeps duplicates deterministic.
template <size_t N, class F>
void for_each_line(const Shape& shape, int64_t dim, const std::array<const int64_t*, N>& strides,
                   F&& line) {
  const int64_t nd = static_cast<int64_t>(shape.size());
  const int64_t len = shape[dim];
  const int64_t lines = len ? numel_of(shape) / len : 0;
  if (lines == 0) return;
  parallel_for(0, lines, std::max<int64_t>(1, kGrainElements / len), [&](int64_t lo, int64_t hi) {
    for (int64_t l = lo; l < hi; ++l) {
      std::array<int64_t, N> base{};
      int64_t rem = l;
      for (int64_t k = nd - 1; k >= 0; --k) {
        if (k == dim) continue;
        const int64_t c = rem % shape[k];
        rem /= shape[k];
        for (size_t o = 0; o < N; ++o) base[o] += c * strides[o][k];
      }
      line(base);
    }
  });
}

}  // namespace

void index_select(DType dtype, const void* src, int64_t outer, int64_t n, int64_t inner,
                  const int64_t* ix, int64_t m, void* out) {
  if (outer * m * inner == 0) return;
  dispatch_all(dtype, "index_select", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* in = static_cast<const T*>(src);
    T* o = static_cast<T*>(out);
    parallel_for(0, outer * m, std::max<int64_t>(1, kGrainElements / inner),
                 [&](int64_t lo, int64_t hi) {
                   for (int64_t r = lo; r < hi; ++r) {
                     const int64_t a = r / m, j = r % m;
                     std::copy_n(in + (a * n + ix[j]) * inner, inner, o + r * inner);
                   }
                 });
  });
}

void index_lines(IndexMode mode, const Shape& shape, int64_t d, const Operand& idx,
                 const Operand& out, const Operand& src, double value) {
  auto kernel = [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = static_cast<T*>(out.data);
    const int64_t* ix = static_cast<const int64_t*>(idx.data);
    const int64_t len = shape[d];
    const int64_t os = out.strides[d], is = idx.strides[d];
    if (mode == IndexMode::gather) {
      const T* xp = static_cast<const T*>(src.data);
      const int64_t xs = src.strides[d];
      for_each_line<2>(shape, d, {out.strides, src.strides}, [&](const auto& b) {
        for (int64_t j = 0; j < len; ++j) o[b[0] + j * os] = xp[b[1] + ix[b[0] + j * os] * xs];
      });
      return;
    }
    if (mode == IndexMode::scatter_fill) {
      const T v = cast<T>(value);
      for_each_line<2>(shape, d, {idx.strides, out.strides}, [&](const auto& b) {
        for (int64_t j = 0; j < len; ++j) o[b[1] + ix[b[0] + j * is] * os] = v;
      });
      return;
    }
    const T* sp = static_cast<const T*>(src.data);
    const int64_t ss = src.strides[d];
    for_each_line<3>(shape, d, {idx.strides, out.strides, src.strides}, [&](const auto& b) {
      for (int64_t j = 0; j < len; ++j) {
        T& dst = o[b[1] + ix[b[0] + j * is] * os];
        if constexpr (!std::is_same_v<T, bool> && !is_half_v<T>) {
          if (mode == IndexMode::scatter_add) {
            dst = static_cast<T>(dst + sp[b[2] + j * ss]);
            continue;
          }
        }
        dst = sp[b[2] + j * ss];
      }
    });
  };
  if (mode == IndexMode::scatter_add)
    dispatch_numeric(out.dtype, "scatter_add", kernel);
  else
    dispatch_all(out.dtype, mode == IndexMode::gather ? "gather" : "scatter", kernel);
}

void index_add(DType dtype, void* out, int64_t outer, int64_t n, int64_t inner, const int64_t* ix,
               int64_t m, const void* src, double alpha) {
  dispatch_numeric(dtype, "index_add", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (outer * m * inner == 0) return;
    const T a = static_cast<T>(alpha);
    T* o = static_cast<T*>(out);
    const T* sp = static_cast<const T*>(src);
    // Each (outer, column) pair is independent; duplicates of j stay in one
    // thread and in order. Split whichever of outer and inner is larger.
    auto run = [&](int64_t a_lo, int64_t a_hi, int64_t k_lo, int64_t k_hi) {
      for (int64_t i = a_lo; i < a_hi; ++i)
        for (int64_t j = 0; j < m; ++j) {
          T* dst = o + (i * n + ix[j]) * inner;
          const T* row = sp + (i * m + j) * inner;
          for (int64_t k = k_lo; k < k_hi; ++k) dst[k] = static_cast<T>(dst[k] + a * row[k]);
        }
    };
    const int64_t work = std::max<int64_t>(1, m);
    if (outer >= inner) {
      parallel_for(0, outer, std::max<int64_t>(1, kGrainElements / (work * inner)),
                   [&](int64_t lo, int64_t hi) { run(lo, hi, 0, inner); });
    } else {
      parallel_for(0, inner, std::max<int64_t>(1, kGrainElements / (work * outer)),
                   [&](int64_t lo, int64_t hi) { run(0, outer, lo, hi); });
    }
  });
}

// sim's bounds check (the CPU's own ops check on the host): one pass in
// order, so the first bad index is the one recorded.
void checked_indices(const int64_t* idx, int64_t n, int64_t size, int64_t* safe,
                     DeviceErrorFlag* flag, int32_t check) {
  for (int64_t i = 0; i < n; ++i) {
    const bool ok = idx[i] >= 0 && idx[i] < size;
    if (!ok && flag->raised == 0) *flag = {1, check, idx[i]};
    safe[i] = ok ? idx[i] : 0;
  }
}

}  // namespace quanta::cpu
