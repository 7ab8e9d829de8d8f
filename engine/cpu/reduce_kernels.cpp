// The CPU's row reductions: each output reduces one contiguous row (sums,
// products, extrema and their indices, boolean tests, logsumexp, moments,
// norms); the grid reductions over leading or middle dims, read in place;
// and the running sums along one dim (cumsum).
#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "engine/cpu/convert.h"
#include "engine/cpu/kernels.h"
#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"
#include "engine/eigen.h"
#include "engine/kernels/reduce_functors.h"

namespace quanta::cpu {
namespace {

// Sum of n contiguous values; long rows are split across threads.
template <class T, class Acc>
Acc row_sum(const T* p, int64_t n, bool parallel) {
  using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
  if (!parallel || n <= kGrainElements) {
    if constexpr (std::is_floating_point_v<T>) {
      return static_cast<Acc>(Eigen::Map<const Arr>(p, n).sum());
    } else {
      Acc s = 0;
      for (int64_t i = 0; i < n; ++i) s += static_cast<Acc>(p[i]);
      return s;
    }
  }
  const int threads = std::max(1, num_threads());
  std::vector<Acc> partial(threads, Acc(0));
  const int64_t step = (n + threads - 1) / threads;
  parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const int64_t b = c * step, e = std::min(n, b + step);
      if (b < e) partial[c] = row_sum<T, Acc>(p + b, e - b, false);
    }
  });
  Acc s = 0;
  for (Acc v : partial) s += v;
  return s;
}

// Calls f(r, row, n) for each of the `outer` rows of n values (in parallel).
template <class T, class F>
void for_rows(const void* rows, int64_t outer, int64_t n, F f) {
  const T* in = static_cast<const T*>(rows);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n, 1));
  parallel_for(0, outer, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) f(r, in + r * n, n);
  });
}

// Index of the first extremum of n >= 1 values.
template <bool IsMax, class T>
int64_t extreme_index(const T* v, int64_t n) {
  int64_t k = 0;
  for (int64_t i = 1; i < n; ++i)
    if (fn::better<IsMax>(v[i], v[k])) k = i;
  return k;
}

void sum_rows(DType in_dtype, const void* rows, int64_t outer, int64_t inner, void* out) {
  dispatch_all(in_dtype, "sum", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (is_half_v<T>) {
      throw std::logic_error("[sum] 16-bit input reached the kernel");
    } else {
      using O = std::conditional_t<std::is_floating_point_v<T>, T, int64_t>;
      const T* in = static_cast<const T*>(rows);
      O* o = static_cast<O*>(out);
      if (outer == 1) {
        o[0] = row_sum<T, O>(in, inner, true);
      } else {
        parallel_for(0, outer, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(inner, 1)),
                     [&](int64_t lo, int64_t hi) {
                       for (int64_t r = lo; r < hi; ++r)
                         o[r] = row_sum<T, O>(in + r * inner, inner, false);
                     });
      }
    }
  });
}

void prod_rows(DType dtype, const void* rows, int64_t outer, int64_t inner, void* out) {
  dispatch_numeric(dtype, "prod", [&](auto tag) {
    using T = typename decltype(tag)::type;
    // Integers multiply as unsigned: overflow wraps instead of being UB.
    using Acc = std::conditional_t<std::is_integral_v<T>, uint64_t, T>;
    T* o = static_cast<T*>(out);
    for_rows<T>(rows, outer, inner, [&](int64_t r, const T* v, int64_t n) {
      Acc acc = Acc(1);
      for (int64_t i = 0; i < n; ++i) acc *= static_cast<Acc>(v[i]);
      o[r] = static_cast<T>(acc);
    });
  });
}

template <bool IsMax>
void extreme_rows(DType dtype, const void* rows, int64_t outer, int64_t inner, int64_t* indices,
                  void* values) {
  dispatch_numeric(dtype, IsMax ? "max" : "min", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* vo = static_cast<T*>(values);
    for_rows<T>(rows, outer, inner, [&](int64_t r, const T* v, int64_t n) {
      const int64_t k = extreme_index<IsMax>(v, n);
      if (indices) indices[r] = k;
      if (vo) vo[r] = v[k];
    });
  });
}

template <bool All>
void bool_rows(const void* rows, int64_t outer, int64_t inner, void* out) {
  bool* o = static_cast<bool*>(out);
  for_rows<bool>(rows, outer, inner, [&](int64_t r, const bool* v, int64_t n) {
    bool acc = All;
    for (int64_t i = 0; i < n; ++i)
      if (v[i] != All) {
        acc = !All;
        break;
      }
    o[r] = acc;
  });
}

void logsumexp_rows(DType dtype, const void* rows, int64_t outer, int64_t inner, void* out) {
  dispatch_float(dtype, "logsumexp", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = static_cast<T*>(out);
    using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
    for_rows<T>(rows, outer, inner, [&](int64_t r, const T* v, int64_t n) {
      if (n == 0) {
        o[r] = T(-INFINITY);
        return;
      }
      Eigen::Map<const Arr> a(v, n);
      const T m = a.template maxCoeff<Eigen::PropagateNaN>();
      o[r] = fn::logsumexp_from(m, std::isfinite(m) ? T((a - m).exp().sum()) : T(0));
    });
  });
}

// Folds src viewed as [outer, a, keep, b] (ReduceGrid) into out[outer, keep].
// A job folds a block of up to kGridBlock outputs (their accumulators stay
// in L1) over a piece of a, walking its slabs [keep, b] in memory order
// (b == 1: contiguous rows, which the compiler vectorizes). a is cut into up
// to kGridPieces pieces of at least kGridPieceElements values, read as long
// sequential stretches; the pieces' partial results combine in order. The
// cut depends on the shape only: the same input gives the same bits
// whatever the thread count.
constexpr int64_t kGridBlock = 4096;
constexpr int64_t kGridPieces = 16;
constexpr int64_t kGridPieceElements = int64_t(1) << 17;

template <class T, class Acc, class Fold>
void fold_grid(const T* src, const ReduceGrid& g, Fold fold, Acc* out) {
  const int64_t block = std::max<int64_t>(1, std::min(g.keep, kGridBlock));
  const int64_t kblocks = (g.keep + block - 1) / block;
  const int64_t line = g.keep * g.b;
  const int64_t piece =
      std::clamp<int64_t>(std::max((g.a + kGridPieces - 1) / kGridPieces,
                                   kGridPieceElements / std::max<int64_t>(block * g.b, 1)),
                          1, std::max<int64_t>(g.a, 1));
  const int64_t pieces = g.a == 0 ? 1 : (g.a + piece - 1) / piece;
  // (Not a vector: vector<bool> has no data().)
  std::unique_ptr<Acc[]> partial(pieces > 1 ? new Acc[g.outer * pieces * g.keep] : nullptr);
  // Job (o, p, kb): outputs [kb * block, +block) of row o over i in piece p.
  parallel_for(0, g.outer * pieces * kblocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t job = lo; job < hi; ++job) {
      const int64_t kb = job % kblocks, p = job / kblocks % pieces, o = job / kblocks / pieces;
      const int64_t k0 = kb * block, k1 = std::min(g.keep, k0 + block);
      Acc* acc = pieces > 1 ? partial.get() + (o * pieces + p) * g.keep : out + o * g.keep;
      for (int64_t k = k0; k < k1; ++k) acc[k] = Fold::template start<Acc>();
      const int64_t i1 = std::min(g.a, (p + 1) * piece);
      for (int64_t i = p * piece; i < i1; ++i) {
        const T* slab = src + (o * g.a + i) * line;
        if (g.b == 1) {
          for (int64_t k = k0; k < k1; ++k) acc[k] = fold(acc[k], static_cast<Acc>(slab[k]));
        } else {
          for (int64_t k = k0; k < k1; ++k) {
            Acc r = acc[k];
            for (int64_t j = 0; j < g.b; ++j) r = fold(r, static_cast<Acc>(slab[k * g.b + j]));
            acc[k] = r;
          }
        }
      }
    }
  });
  if (pieces <= 1) return;
  parallel_for(0, g.outer * g.keep, kGrainElements / pieces + 1, [&](int64_t lo, int64_t hi) {
    for (int64_t e = lo; e < hi; ++e) {
      const int64_t o = e / g.keep, k = e % g.keep;
      const Acc* part = partial.get() + o * pieces * g.keep + k;
      Acc r = part[0];
      for (int64_t p = 1; p < pieces; ++p) r = fold(r, part[p * g.keep]);
      out[e] = r;
    }
  });
}

// fold_grid into Acc, then out as O (a wrapping product of integers narrows).
template <class T, class Acc, class O, class Fold>
void fold_grid_to(const void* src, const ReduceGrid& g, Fold fold, void* out) {
  if constexpr (std::is_same_v<Acc, O>) {
    fold_grid<T, Acc>(static_cast<const T*>(src), g, fold, static_cast<O*>(out));
  } else {
    std::vector<Acc> acc(g.outer * g.keep);
    fold_grid<T, Acc>(static_cast<const T*>(src), g, fold, acc.data());
    O* o = static_cast<O*>(out);
    for (std::size_t i = 0; i < acc.size(); ++i) o[i] = static_cast<O>(acc[i]);
  }
}

// 16-bit rows (the table's half_reductions): sum, max and min of bf16 or f16
// values in f32, into f32 outputs. Rows are widened in L1-sized pieces, each
// piece summed by Eigen and the pieces added in order; one long row is cut
// into pieces of kGrainElements (by its length only) summed on the threads
// and added in order.
constexpr int64_t kHalfPiece = 1024;

template <class H, class Fold>
void half_rows(Fold fold, const H* in, int64_t outer, int64_t inner, float* out) {
  const auto row = [fold](const H* v, int64_t n) {
    float buf[kHalfPiece];
    float acc = Fold::template start<float>();
    for (int64_t a = 0; a < n; a += kHalfPiece) {
      const int64_t m = std::min(kHalfPiece, n - a);
      for (int64_t i = 0; i < m; ++i) buf[i] = static_cast<float>(v[a + i]);
      if constexpr (std::is_same_v<Fold, fn::FoldSum>) {
        acc += Eigen::Map<const Eigen::ArrayXf>(buf, m).sum();
      } else {
        for (int64_t i = 0; i < m; ++i) acc = fold(acc, buf[i]);
      }
    }
    return acc;
  };
  if (outer == 1 && inner > kGrainElements) {
    const int64_t parts = (inner + kGrainElements - 1) / kGrainElements;
    std::vector<float> partial(parts);
    parallel_for(0, parts, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t p = lo; p < hi; ++p) {
        const int64_t b = p * kGrainElements;
        partial[p] = row(in + b, std::min(inner, b + kGrainElements) - b);
      }
    });
    float acc = partial[0];
    for (int64_t p = 1; p < parts; ++p) acc = fold(acc, partial[p]);
    out[0] = acc;
    return;
  }
  parallel_for(0, outer, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(inner, 1)),
               [&](int64_t lo, int64_t hi) {
                 for (int64_t r = lo; r < hi; ++r) out[r] = row(in + r * inner, inner);
               });
}

void check_half_op(RowReduce op) {
  if (!fn::reduces_half(op))
    throw std::logic_error(std::string("[") + op_name(op) + "] 16-bit input reached the kernel");
}

}  // namespace

void reduce_rows(RowReduce op, DType in_dtype, const void* rows, int64_t outer, int64_t inner,
                 void* out) {
  if (visit_half(in_dtype, [&](auto tag) {
        using H = typename decltype(tag)::type;
        check_half_op(op);
        fn::visit_fold(op, [&](auto fold) {
          half_rows(fold, static_cast<const H*>(rows), outer, inner, static_cast<float*>(out));
        });
      }))
    return;
  switch (op) {
    case RowReduce::sum:
      return sum_rows(in_dtype, rows, outer, inner, out);
    case RowReduce::prod:
      return prod_rows(in_dtype, rows, outer, inner, out);
    case RowReduce::max:
      return extreme_rows<true>(in_dtype, rows, outer, inner, nullptr, out);
    case RowReduce::min:
      return extreme_rows<false>(in_dtype, rows, outer, inner, nullptr, out);
    case RowReduce::all:
      return bool_rows<true>(rows, outer, inner, out);
    case RowReduce::any:
      return bool_rows<false>(rows, outer, inner, out);
    case RowReduce::logsumexp:
      return logsumexp_rows(in_dtype, rows, outer, inner, out);
  }
  throw std::logic_error("[reduce_rows] unknown row reduction");
}

void reduce_grid(RowReduce op, DType in_dtype, const void* src, const ReduceGrid& grid, void* out) {
  if (visit_half(in_dtype, [&](auto tag) {
        using H = typename decltype(tag)::type;
        check_half_op(op);
        fn::visit_fold(op, [&](auto fold) { fold_grid_to<H, float, float>(src, grid, fold, out); });
      }))
    return;
  switch (op) {
    case RowReduce::sum:
      return dispatch_all(in_dtype, "sum", [&](auto tag) {
        using T = typename decltype(tag)::type;
        if constexpr (is_half_v<T>) {
          throw std::logic_error("[sum] 16-bit input reached the kernel");
        } else {
          using Acc = std::conditional_t<std::is_floating_point_v<T>, T, int64_t>;
          fold_grid_to<T, Acc, Acc>(src, grid, fn::FoldSum{}, out);
        }
      });
    case RowReduce::prod:
      return dispatch_numeric(in_dtype, "prod", [&](auto tag) {
        using T = typename decltype(tag)::type;
        using Acc = std::conditional_t<std::is_integral_v<T>, uint64_t, T>;
        fold_grid_to<T, Acc, T>(src, grid, fn::FoldProd{}, out);
      });
    case RowReduce::max:
    case RowReduce::min:
      return dispatch_numeric(in_dtype, op_name(op), [&](auto tag) {
        using T = typename decltype(tag)::type;
        if (op == RowReduce::max)
          fold_grid_to<T, T, T>(src, grid, fn::FoldExtreme<true>{}, out);
        else
          fold_grid_to<T, T, T>(src, grid, fn::FoldExtreme<false>{}, out);
      });
    case RowReduce::all:
      return fold_grid_to<bool, bool, bool>(src, grid, fn::FoldBool<true>{}, out);
    case RowReduce::any:
      return fold_grid_to<bool, bool, bool>(src, grid, fn::FoldBool<false>{}, out);
    case RowReduce::logsumexp:
      break;
  }
  throw std::logic_error(std::string("[reduce_grid] ") + op_name(op) + " has no grid reduction");
}

void index_rows(RowReduce op, DType dtype, const void* rows, int64_t outer, int64_t inner,
                int64_t* indices, void* values) {
  if (op == RowReduce::max) return extreme_rows<true>(dtype, rows, outer, inner, indices, values);
  if (op == RowReduce::min) return extreme_rows<false>(dtype, rows, outer, inner, indices, values);
  throw std::logic_error(std::string("[index_rows] ") + op_name(op) + " has no index");
}

void stat_rows(RowStat op, double param, DType dtype, const void* rows, int64_t outer,
               int64_t inner, void* out) {
  dispatch_float(dtype, op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = static_cast<T*>(out);
    if (op != RowStat::norm) {
      const double divisor = param;
      const bool take_sqrt = op == RowStat::std;
      using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
      for_rows<T>(rows, outer, inner, [&](int64_t r, const T* v, int64_t n) {
        // Two passes: squared deviations, no cancellation from sum(x^2) - n mean^2.
        Eigen::Map<const Arr> a(v, n);
        const T m = n ? a.mean() : T(NAN);
        const double res = static_cast<double>((a - m).square().sum()) / divisor;
        o[r] = static_cast<T>(take_sqrt ? std::sqrt(res) : res);
      });
      return;
    }
    const double p = param;
    const bool inf = std::isinf(p);
    for_rows<T>(rows, outer, inner, [&](int64_t r, const T* v, int64_t n) {
      double acc = 0;
      if (inf) {
        for (int64_t i = 0; i < n; ++i) {
          const double a = std::abs(static_cast<double>(v[i]));
          if (a != a) {
            acc = a;
            break;
          }
          acc = std::max(acc, a);
        }
      } else if (p == 1.0) {
        for (int64_t i = 0; i < n; ++i) acc += std::abs(static_cast<double>(v[i]));
      } else if (p == 2.0) {
        for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(v[i]) * v[i];
        acc = std::sqrt(acc);
      } else {
        for (int64_t i = 0; i < n; ++i) acc += std::pow(std::abs(static_cast<double>(v[i])), p);
        acc = std::pow(acc, 1.0 / p);
      }
      o[r] = static_cast<T>(acc);
    });
  });
}

void norm_n(DType dtype, double p, const TensorSpanList& tensors, double* out) {
  // Each tensor as stat_rows takes it as one row (the same bits), widened.
  dispatch_float(dtype, "clip_grad_norm_", [&](auto tag) {
    using T = typename decltype(tag)::type;
    for (int64_t i = 0; i < tensors.count; ++i) {
      T norm;
      stat_rows(RowStat::norm, p, dtype, tensors.data[i].data, 1, tensors.data[i].n, &norm);
      out[i] = static_cast<double>(norm);
    }
  });
}

void cumsum(DType dtype, const void* in, int64_t outer, int64_t n, int64_t inner, bool reverse,
            void* out) {
  dispatch_numeric(dtype, "cumsum", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* src = static_cast<const T*>(in);
    T* dst = static_cast<T*>(out);
    const int64_t block = n * inner;
    parallel_for(0, n == 0 ? 0 : outer,
                 std::max<int64_t>(1, kGrainElements / std::max<int64_t>(block, 1)),
                 [&](int64_t lo, int64_t hi) {
                   for (int64_t o = lo; o < hi; ++o) {
                     const T* s = src + o * block;
                     T* t = dst + o * block;
                     if (inner == 1) {
                       // One contiguous line: a plain running sum.
                       T acc = T(0);
                       for (int64_t i = 0; i < n; ++i) {
                         const int64_t j = reverse ? n - 1 - i : i;
                         acc = static_cast<T>(acc + s[j]);
                         t[j] = acc;
                       }
                       continue;
                     }
                     const int64_t first = reverse ? n - 1 : 0, step = reverse ? -1 : 1;
                     for (int64_t k = 0; k < inner; ++k)
                       t[first * inner + k] = s[first * inner + k];
                     for (int64_t i = first + step; i >= 0 && i < n; i += step) {
                       const T* prev = t + (i - step) * inner;
                       for (int64_t k = 0; k < inner; ++k)
                         t[i * inner + k] = prev[k] + s[i * inner + k];
                     }
                   }
                 });
  });
}

}  // namespace quanta::cpu
