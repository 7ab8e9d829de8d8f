// The CPU's group normalisation entries (group_norm, group_norm_grad). Each
// batch item is a [channels, spatial] array (row-major channels first,
// column-major channels last), so every pass runs along contiguous memory
// in Eigen's vector code: per-channel sums in f64, then each group's sum of
// its channels' in order. The per-element rounding steps are those of
// engine/kernels/group_norm.h's functors, which CUDA's kernels call.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/cpu/kernels.h"
#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"
#include "engine/eigen.h"
#include "engine/kernels/group_norm.h"

namespace quanta::cpu {
namespace {

template <class T>
using Column = Eigen::Array<T, Eigen::Dynamic, 1>;

// Items per thread's chunk: one thread below kGrainElements.
int64_t grain_of(const NormGeom& g) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(g.channels * g.spatial, 1));
}

// A batch item's [C, S] block as an Eigen array: row-major channels first,
// column-major channels last, so its rows or columns lie contiguous.
template <class T, int Order>
struct ItemMaps {
  using Block = Eigen::Array<T, Eigen::Dynamic, Eigen::Dynamic, Order>;
  const NormGeom& g;
  Eigen::Map<const Block> in(const T* p) const { return {p, g.channels, g.spatial}; }
  Eigen::Map<Block> out(T* p) const { return {p, g.channels, g.spatial}; }
};

// f(ItemMaps) for g's layout: the one place the layout picks a type.
template <class T, class F>
void with_item_maps(const NormGeom& g, F f) {
  if (g.channels_last)
    f(ItemMaps<T, Eigen::ColMajor>{g});
  else
    f(ItemMaps<T, Eigen::RowMajor>{g});
}

// out[c] = of(the f64 sum of channel_sums over c's group, added in channel
// order): a group's value, held by each of its channels.
template <class T, class Of>
void per_group(const NormGeom& g, const Column<double>& channel_sums, Of of, Column<T>& out) {
  const int64_t cg = g.group_channels();
  out.resize(g.channels);
  for (int64_t grp = 0; grp < g.groups; ++grp) {
    double s = 0;
    for (int64_t c = grp * cg; c < (grp + 1) * cg; ++c) s += channel_sums[c];
    out.segment(grp * cg, cg).setConstant(of(s));
  }
}

// out[c] = values[item's group of c]: mean or rstd per channel.
template <class T>
void spread_groups(const NormGeom& g, const T* values, int64_t item, Column<T>& out) {
  const int64_t cg = g.group_channels();
  out.resize(g.channels);
  for (int64_t grp = 0; grp < g.groups; ++grp)
    out.segment(grp * cg, cg).setConstant(values[item * g.groups + grp]);
}

}  // namespace

void group_norm(DType dtype, const NormGeom& g, double eps, const void* x, const void* w,
                const void* b, void* y, void* mean, void* rstd) {
  dispatch_float(dtype, "group_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xs = static_cast<const T*>(x);
    T* ys = static_cast<T*>(y);
    const int64_t m = g.group_size(), item_size = g.channels * g.spatial, cg = g.group_channels();
    const Eigen::Map<const Column<T>> ws(static_cast<const T*>(w), w ? g.channels : 0);
    const Eigen::Map<const Column<T>> bs(static_cast<const T*>(b), b ? g.channels : 0);
    with_item_maps<T>(g, [&](auto maps) {
      parallel_for(0, g.batch, grain_of(g), [&](int64_t lo, int64_t hi) {
        Column<double> sums, sq;
        Column<T> mu, r;
        const auto mean_of = [m](double s) { return fn::norm_mean<T>(s, m); };
        const auto rstd_of = [m, eps](double s) {
          return fn::norm_rstd(fn::norm_mean<T>(s, m), static_cast<T>(eps));
        };
        for (int64_t item = lo; item < hi; ++item) {
          const auto X = maps.in(xs + item * item_size);
          auto Y = maps.out(ys + item * item_size);
          sums = X.template cast<double>().rowwise().sum();
          per_group(g, sums, mean_of, mu);
          sq = (X.template cast<double>().colwise() - mu.template cast<double>())
                   .square()
                   .rowwise()
                   .sum();
          per_group(g, sq, rstd_of, r);
          for (int64_t grp = 0; grp < g.groups; ++grp) {
            static_cast<T*>(mean)[item * g.groups + grp] = mu[grp * cg];
            static_cast<T*>(rstd)[item * g.groups + grp] = r[grp * cg];
          }
          // fn::norm_out's steps: (x - mean) rstd, times w, plus b.
          Y = (X.colwise() - mu).colwise() * r;
          if (w) Y = Y.colwise() * ws;
          if (b) Y = Y.colwise() + bs;
        }
      });
    });
  });
}

void group_norm_grad(DType dtype, const NormGeom& g, const void* x, const void* w, const void* mean,
                     const void* rstd, const void* gy, void* gx, void* gw, void* gb,
                     bool accumulate_gx) {
  dispatch_float(dtype, "group_norm backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xs = static_cast<const T*>(x);
    const T* gys = static_cast<const T*>(gy);
    const int64_t m = g.group_size(), item_size = g.channels * g.spatial;
    const Eigen::Map<const Column<T>> ws(static_cast<const T*>(w), w ? g.channels : 0);
    // Each item's per-channel sums of gy xhat and gy, added over the items
    // in order afterwards: the affine gradients.
    const bool affine = gw || gb;
    std::vector<double> partial(affine ? static_cast<size_t>(2 * g.batch * g.channels) : 0);
    with_item_maps<T>(g, [&](auto maps) {
      using Block = typename decltype(maps)::Block;
      parallel_for(0, g.batch, grain_of(g), [&](int64_t lo, int64_t hi) {
        Column<T> mu, r, mean_g, mean_gx;
        Column<double> sum_g, sum_gx;
        Block xhat, gs;
        const auto mean_of = [m](double s) { return fn::norm_mean<T>(s, m); };
        for (int64_t item = lo; item < hi; ++item) {
          const auto X = maps.in(xs + item * item_size);
          const auto G = maps.in(gys + item * item_size);
          spread_groups(g, static_cast<const T*>(mean), item, mu);
          spread_groups(g, static_cast<const T*>(rstd), item, r);
          xhat = (X.colwise() - mu).colwise() * r;
          if (affine) {
            double* p = partial.data() + 2 * item * g.channels;
            Eigen::Map<Column<double>>(p, g.channels) =
                (G.template cast<double>() * xhat.template cast<double>()).rowwise().sum();
            Eigen::Map<Column<double>>(p + g.channels, g.channels) =
                G.template cast<double>().rowwise().sum();
          }
          if (!gx) continue;
          // fn::norm_scaled_grad's and fn::norm_grad_x's steps.
          if (w)
            gs = G.colwise() * ws;
          else
            gs = G;
          sum_g = gs.template cast<double>().rowwise().sum();
          sum_gx = (gs.template cast<double>() * xhat.template cast<double>()).rowwise().sum();
          per_group(g, sum_g, mean_of, mean_g);
          per_group(g, sum_gx, mean_of, mean_gx);
          auto out = maps.out(static_cast<T*>(gx) + item * item_size);
          const auto v = ((gs.colwise() - mean_g) - (xhat.colwise() * mean_gx)).colwise() * r;
          if (accumulate_gx)
            out += v;
          else
            out = v;
        }
      });
    });
    if (!affine) return;
    parallel_for(0, g.channels, 1 + kGrainElements / std::max<int64_t>(g.batch, 1),
                 [&](int64_t lo, int64_t hi) {
                   for (int64_t c = lo; c < hi; ++c) {
                     double sum_gxhat = 0, sum_gy = 0;
                     for (int64_t item = 0; item < g.batch; ++item) {
                       sum_gxhat += partial[2 * item * g.channels + c];
                       sum_gy += partial[(2 * item + 1) * g.channels + c];
                     }
                     if (gw) static_cast<T*>(gw)[c] = static_cast<T>(sum_gxhat);
                     if (gb) static_cast<T*>(gb)[c] = static_cast<T>(sum_gy);
                   }
                 });
  });
}

}  // namespace quanta::cpu
