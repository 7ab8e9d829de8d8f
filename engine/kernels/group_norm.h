#pragma once
// Group normalisation as the kernel table's group_norm entries take it: the
// geometry, the walk over one group's elements in either activation layout,
// and the per-element math (layer normalisation is the case of one group and
// no spatial dims). CUDA's kernels call all of it; the CPU's run the same
// rounding steps in Eigen's vector code and call the statistics' functions,
// and tests/engine/test_kernel_table.cpp runs the walk and the element
// functions on the host against the CPU kernel.
#include <cmath>
#include <cstdint>

#include "engine/kernels/functors.h"  // QUANTA_HD

namespace quanta {

/** x viewed [batch, channels, spatial] (stored so, or [batch, spatial,
 * channels] when channels_last), normalised over each of `groups` groups of
 * channels / groups channels and all of spatial. layer_norm over rows of n
 * values is {rows, n, 1, 1}. groups divides channels. */
struct NormGeom {
  int64_t batch = 0, channels = 0, spatial = 1, groups = 1;
  bool channels_last = false;

  QUANTA_HD int64_t group_channels() const { return channels / groups; }
  /** Elements of one group (of batch item and group). */
  QUANTA_HD int64_t group_size() const { return group_channels() * spatial; }
  /** Groups in all: the length of the mean and rstd arrays. */
  QUANTA_HD int64_t group_count() const { return batch * groups; }
};

namespace fn {

/** The elements of group q (= item * groups + group) as an [outer, inner]
 * walk with inner contiguous in memory: channels first, outer = the group's
 * channels and inner = spatial; channels last, outer = spatial and inner =
 * the group's channels. */
struct GroupWalk {
  int64_t base = 0;  // the group's first element
  int64_t outer = 0, inner = 1;
  int64_t outer_stride = 0;  // elements between outer steps
  int64_t first_channel = 0;
  bool channel_outer = true;  // the channel is first_channel + (outer ? i : j)

  QUANTA_HD int64_t size() const { return outer * inner; }
  QUANTA_HD int64_t offset(int64_t i, int64_t j) const { return base + i * outer_stride + j; }
  QUANTA_HD int64_t channel(int64_t i, int64_t j) const {
    return first_channel + (channel_outer ? i : j);
  }
};

QUANTA_HD inline GroupWalk group_walk(const NormGeom& g, int64_t q) {
  const int64_t item = q / g.groups, group = q % g.groups, cg = g.group_channels();
  const int64_t item_base = item * g.channels * g.spatial;
  GroupWalk w;
  w.first_channel = group * cg;
  if (g.channels_last) {
    w.base = item_base + group * cg;
    w.outer = g.spatial, w.inner = cg, w.outer_stride = g.channels;
    w.channel_outer = false;
  } else {
    w.base = item_base + group * cg * g.spatial;
    w.outer = cg, w.inner = g.spatial, w.outer_stride = g.spatial;
  }
  return w;
}

/** Calls f(offset, channel) for the walk's elements first, first + step, ...
 * in that order (a thread's share: first = its index, step = the threads;
 * the CPU's whole walk: 0 and 1), moving (i, j) on by one carry instead of a
 * division per element. */
template <class F>
QUANTA_HD inline void walk_share(const GroupWalk& w, int64_t first, int64_t step, F f) {
  const int64_t m = w.size();
  if (first >= m) return;
  const int64_t di = step / w.inner, dj = step % w.inner;
  int64_t i = first / w.inner, j = first % w.inner;
  for (int64_t e = first; e < m; e += step) {
    f(w.offset(i, j), w.channel(i, j));
    i += di, j += dj;
    if (j >= w.inner) j -= w.inner, ++i;
  }
}

/** 1 / sqrt(var + eps): a group's rstd from its biased variance. */
template <class T>
QUANTA_HD inline T norm_rstd(T var, T eps) {
  return T(1) / std::sqrt(var + eps);
}

/** The mean of m values from their sum (0 for no values, so an empty group
 * holds no NaN). */
template <class T, class A>
QUANTA_HD inline T norm_mean(A sum, int64_t m) {
  return m > 0 ? static_cast<T>(sum / static_cast<A>(m)) : T(0);
}

/** One output: (x - mean) rstd, times w[c] and plus b[c] where given (null:
 * none), each step rounded to T as the composed ops did. */
template <class T>
QUANTA_HD inline T norm_out(T x, T mean, T rstd, const T* w, const T* b, int64_t c) {
  T v = (x - mean) * rstd;
  if (w) v = v * w[c];
  if (b) v = v + b[c];
  return v;
}

/** The output gradient times the weight, g = gy w[c] (gy without one). */
template <class T>
QUANTA_HD inline T norm_scaled_grad(T gy, const T* w, int64_t c) {
  return w ? gy * w[c] : gy;
}

/** The input gradient of one element: rstd (g - mean(g) - xhat mean(g xhat))
 * over its group, g = norm_scaled_grad, xhat = (x - mean) rstd. */
template <class T>
QUANTA_HD inline T norm_grad_x(T g, T xhat, T rstd, T mean_g, T mean_g_xhat) {
  return rstd * (g - mean_g - xhat * mean_g_xhat);
}

}  // namespace fn
}  // namespace quanta
