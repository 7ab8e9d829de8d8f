// The CPU's row reductions: each output reduces one contiguous row (sums,
// products, extrema and their indices, boolean tests, logsumexp, moments,
// norms), and the running sums along one dim (cumsum).
#include <algorithm>
#include <cmath>
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

}  // namespace

void reduce_rows(RowReduce op, DType in_dtype, const void* rows, int64_t outer, int64_t inner,
                 void* out) {
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
