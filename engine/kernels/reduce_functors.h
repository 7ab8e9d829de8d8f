#pragma once
// The per-element math of the row reductions that both devices share, in the
// manner of functors.h: g++ compiles it for the CPU kernels
// (engine/cpu/reduce_kernels.cpp), nvcc for the CUDA ones
// (engine/cuda/reduce_kernels.cu). The CPU's loops call these exactly where
// they did the same arithmetic before, so its results are bit for bit the
// same; the CUDA kernels combine per-thread partials with the same rules.
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "engine/kernels/functors.h"  // QUANTA_HD
#include "engine/kernels/table.h"     // RowReduce

namespace quanta::fn {

/** True when v replaces best as the running extremum (max when IsMax, else
 * min): NaN beats everything and the first NaN is kept, as in PyTorch's
 * max/min; ties keep best. */
template <bool IsMax, class T>
QUANTA_HD inline bool better(T v, T best) {
  if constexpr (std::is_floating_point_v<T>) {
    if (v != v) return best == best;
  }
  return IsMax ? v > best : v < best;
}

/** A candidate extremum: value and index; index -1 for none yet. */
template <class T>
struct ArgBest {
  T v;
  int64_t i;
};

/** Combines two candidates so that any grouping of a row's elements ends at
 * the sequential answer of `better` (first NaN, else first extremum): the
 * better value wins, equal values (or two NaNs) go to the lower index. */
template <bool IsMax>
struct ArgBestOp {
  template <class T>
  QUANTA_HD ArgBest<T> operator()(const ArgBest<T>& a, const ArgBest<T>& b) const {
    if (a.i < 0) return b;
    if (b.i < 0) return a;
    if (better<IsMax>(b.v, a.v)) return b;
    if (better<IsMax>(a.v, b.v)) return a;
    return a.i < b.i ? a : b;  // equal, or both NaN
  }
};

/** log(sum(exp(x))) from the row's max m and s = sum(exp(x - m)): NaN stays
 * NaN, all -inf gives -inf, any +inf gives +inf (s is not used then). */
template <class T>
QUANTA_HD inline T logsumexp_from(T m, T s) {
  return std::isfinite(m) ? m + std::log(s) : m;
}

/** The folds of a grid reduction (reduce_grid): `start` leaves any value
 * unchanged, and the step is associative, so a device may cut a fold into
 * pieces and combine their results with the same step (in a fixed order:
 * deterministic). Extrema propagate NaN, as reduce_rows' max and min do. */
struct FoldSum {
  template <class A>
  static QUANTA_HD A start() {
    return A(0);
  }
  template <class A>
  QUANTA_HD A operator()(A acc, A v) const {
    return acc + v;
  }
};

struct FoldProd {
  template <class A>
  static QUANTA_HD A start() {
    return A(1);
  }
  template <class A>
  QUANTA_HD A operator()(A acc, A v) const {
    return acc * v;
  }
};

template <bool IsMax>
struct FoldExtreme {
  template <class A>
  static QUANTA_HD A start() {
    if constexpr (std::is_floating_point_v<A>)
      return IsMax ? -std::numeric_limits<A>::infinity() : std::numeric_limits<A>::infinity();
    else
      return IsMax ? std::numeric_limits<A>::lowest() : std::numeric_limits<A>::max();
  }
  template <class A>
  QUANTA_HD A operator()(A acc, A v) const {
    return IsMax ? Maximum{}(acc, v) : Minimum{}(acc, v);
  }
};

/** all (And) and any (!And) over bool. */
template <bool And>
struct FoldBool {
  template <class A>
  static QUANTA_HD A start() {
    return And;
  }
  template <class A>
  QUANTA_HD A operator()(A acc, A v) const {
    return And ? (acc && v) : (acc || v);
  }
};

/** Calls f(fold) with the fold of reduce_grid's `op` (sum, prod, max, min,
 * all, any); false, calling nothing, for logsumexp, which has none. Host
 * code: the devices pick their kernels with it. */
template <class F>
bool visit_fold(RowReduce op, F&& f) {
  switch (op) {
    case RowReduce::sum:
      return f(FoldSum{}), true;
    case RowReduce::prod:
      return f(FoldProd{}), true;
    case RowReduce::max:
      return f(FoldExtreme<true>{}), true;
    case RowReduce::min:
      return f(FoldExtreme<false>{}), true;
    case RowReduce::all:
      return f(FoldBool<true>{}), true;
    case RowReduce::any:
      return f(FoldBool<false>{}), true;
    case RowReduce::logsumexp:
      break;
  }
  return false;
}

/** The reductions a device takes 16-bit input for (half_reductions), in f32. */
constexpr bool reduces_half(RowReduce op) {
  return op == RowReduce::sum || op == RowReduce::max || op == RowReduce::min;
}

/** Values a strided fold reads before it folds any. A thread that folds a
 * column one value at a time has one load in flight, a DRAM round trip per
 * row on a GPU: the H200 summed a [4096, 16384] f32 tensor over dim 0 at 0.6
 * TB/s that way, 6.6x the time of a copy. */
inline constexpr int kStridedLoads = 8;

/** acc folded with load(0), load(1), ..., load(n - 1) in that order
 * (fold(acc, value, i) -> acc), kStridedLoads values loaded before any of
 * them is folded: the order, and so the bits, of a plain loop, with the
 * loads of a batch in flight together. load(i) must not read what fold
 * writes. */
template <class Acc, class Load, class Fold>
QUANTA_HD inline Acc fold_loaded(Acc acc, int64_t n, Load load, Fold fold) {
  using V = decltype(load(int64_t{0}));
  int64_t i = 0;
  for (; i + kStridedLoads <= n; i += kStridedLoads) {
    V batch[kStridedLoads];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int u = 0; u < kStridedLoads; ++u) batch[u] = load(i + u);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int u = 0; u < kStridedLoads; ++u) acc = fold(acc, batch[u], i + u);
  }
  for (; i < n; ++i) acc = fold(acc, load(i), i);
  return acc;
}

/** acc folded with v[0], v[stride], ..., v[(n - 1) stride] in that order
 * (fold(acc, value) -> acc, each value converted to Acc), reading
 * kStridedLoads values ahead of the folding (fold_loaded). */
template <class Acc, class T, class Fold>
QUANTA_HD inline Acc fold_strided(Acc acc, const T* v, int64_t n, int64_t stride, Fold fold) {
  return fold_loaded(
      acc, n, [v, stride](int64_t i) { return v[i * stride]; },
      [&fold](Acc a, T x, int64_t) { return fold(a, static_cast<Acc>(x)); });
}

/** acc folded with f(acc, v[i], i) for i = first, first + step, ... below n,
 * in that order, kStridedLoads values read before any is folded
 * (fold_loaded): one thread's share of a row whose elements a block's
 * threads take in turn (first = the thread, step = the block's size). */
template <class Acc, class T, class F>
QUANTA_HD inline Acc fold_share(Acc acc, const T* v, int64_t first, int64_t step, int64_t n, F f) {
  const int64_t count = first < n ? (n - first + step - 1) / step : 0;
  return fold_loaded(
      acc, count, [v, first, step](int64_t u) { return v[first + u * step]; },
      [&f, first, step](Acc a, T x, int64_t u) { return f(a, x, first + u * step); });
}

/** acc folded with value(i, j) for (i, j) = (t / b, t % b), t = first,
 * first + step, ... below a * b (b >= 1), in that order (fold(acc, v) ->
 * acc): a thread's share of an [a, b] walk, advanced by (step / b, step %
 * b) and one carry instead of a division per value, with kStridedLoads
 * values read before any is folded (fold_loaded; a walk that folded each
 * value as it came kept one load in flight). */
template <class Acc, class Value, class Fold>
QUANTA_HD inline Acc fold_pairs(Acc acc, int64_t first, int64_t step, int64_t a, int64_t b,
                                Value value, Fold fold) {
  const int64_t total = a * b;
  const int64_t n = first < total ? (total - first + step - 1) / step : 0;
  const int64_t di = step / b, dj = step % b;
  int64_t i = first / b, j = first % b;
  using V = decltype(value(int64_t{0}, int64_t{0}));
  return fold_loaded(
      acc, n,
      [&](int64_t) {  // called once per value, in order: the walk's state moves on
        const V v = value(i, j);
        i += di, j += dj;
        if (j >= b) j -= b, ++i;
        return v;
      },
      [&fold](Acc x, V v, int64_t) { return fold(x, v); });
}

}  // namespace quanta::fn
