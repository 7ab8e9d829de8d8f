// The CUDA row reductions (sums, products, extrema and their indices,
// boolean tests, logsumexp, var/std, norms), the grid reductions over leading
// or middle dims read in place, cumsum and softmax.
//
// A row is reduced by one block of kThreadsPerBlock threads (a grid-stride
// loop over rows): each thread folds the elements i = tid, tid + blockDim,
// ... in order, then CUB's block reduction combines the threads. Lines along
// a strided dim (inner > 1) are walked by one thread each, in the CPU's
// order. No float atomics, a fixed split: results are deterministic. The
// combination rules (NaN handling, first index on ties) are the CPU's, from
// engine/kernels/reduce_functors.h.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "engine/cuda/block_combine.cuh"
#include "engine/cuda/check.cuh"
#include "engine/cuda/device_types.cuh"
#include "engine/cuda/kernels.h"
#include "engine/cuda/launch.h"
#include "engine/kernels/functors.h"
#include "engine/kernels/reduce_functors.h"

namespace quanta::cuda {
namespace {

// This thread's fold of its share of row v (n values): f(acc, v[i], i) for
// i = tid, tid + blockDim, ..., several loads in flight (fn::fold_share), in
// the plain loop's order, so the bits are the plain loop's.
template <class Acc, class T, class F>
__device__ Acc fold_thread_share(Acc acc, const T* v, int64_t n, F f) {
  return fn::fold_share(acc, v, threadIdx.x, blockDim.x, n, f);
}

// The max of row v (NaN propagates; -inf for an empty row) and the sum of
// exp(v[i] - m), each the block's and returned to every thread (all threads
// call them together): logsumexp's and softmax's passes.
template <class T>
__device__ T block_row_max(const T* v, int64_t n) {
  const T m =
      fold_thread_share(T(-INFINITY), v, n, [](T a, T x, int64_t) { return fn::Maximum{}(a, x); });
  return block_combine(m, fn::Maximum{});
}
template <class T>
__device__ T block_row_sum_exp(const T* v, int64_t n, T m) {
  const T s = fold_thread_share(T(0), v, n, [m](T a, T x, int64_t) { return a + std::exp(x - m); });
  return block_combine(s, fn::Add{});
}

// Blocks for a kernel that gives each of `rows` rows one block.
unsigned row_blocks(int64_t rows) {
  return static_cast<unsigned>(std::min<int64_t>(rows, max_blocks()));
}

// ---- products ----

template <class T, class Acc>
__global__ void prod_kernel(const T* in, int64_t outer, int64_t n, T* out) {
  for (int64_t r = blockIdx.x; r < outer; r += gridDim.x) {
    const T* v = in + r * n;
    const Acc acc = fold_thread_share(Acc(1), v, n,
                                      [](Acc a, T x, int64_t) { return a * static_cast<Acc>(x); });
    const Acc total = block_combine(acc, fn::Mul{});
    if (threadIdx.x == 0) out[r] = static_cast<T>(total);
  }
}

// ---- extrema: the value and the first index ----

template <bool IsMax, class T>
__global__ void extreme_kernel(const T* in, int64_t outer, int64_t n, int64_t* indices, T* values) {
  const fn::ArgBestOp<IsMax> comb;
  for (int64_t r = blockIdx.x; r < outer; r += gridDim.x) {
    const T* v = in + r * n;
    const fn::ArgBest<T> acc =
        fold_thread_share(fn::ArgBest<T>{T(), -1}, v, n, [&](fn::ArgBest<T> a, T x, int64_t i) {
          return comb(a, fn::ArgBest<T>{x, i});
        });
    const fn::ArgBest<T> best = block_combine(acc, comb);
    if (threadIdx.x == 0) {
      if (indices) indices[r] = best.i;
      if (values) values[r] = best.v;
    }
  }
}

// ---- all / any over bool rows ----

template <bool All>
__global__ void bool_kernel(const bool* in, int64_t outer, int64_t n, bool* out) {
  for (int64_t r = blockIdx.x; r < outer; r += gridDim.x) {
    const bool* v = in + r * n;
    int differs = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
      if (v[i] != All) differs = 1;
    differs = __syncthreads_or(differs);
    if (threadIdx.x == 0) out[r] = differs ? !All : All;
  }
}

// ---- logsumexp ----

template <class T>
__global__ void logsumexp_kernel(const T* in, int64_t outer, int64_t n, T* out) {
  for (int64_t r = blockIdx.x; r < outer; r += gridDim.x) {
    const T* v = in + r * n;
    // The max propagates NaN; -inf for an empty row, whose result is -inf.
    const T m = block_row_max(v, n);
    const T s = std::isfinite(m) ? block_row_sum_exp(v, n, m) : T(0);  // the same m everywhere
    if (threadIdx.x == 0) out[r] = fn::logsumexp_from(m, s);
  }
}

// ---- var / std: two passes, the mean then the squared deviations ----

template <class T>
__global__ void moment_kernel(const T* in, int64_t outer, int64_t n, double divisor, bool take_sqrt,
                              T* out) {
  for (int64_t r = blockIdx.x; r < outer; r += gridDim.x) {
    const T* v = in + r * n;
    T s = fold_thread_share(T(0), v, n, [](T a, T x, int64_t) { return a + x; });
    s = block_combine(s, fn::Add{});
    const T m = n ? s / static_cast<T>(n) : T(NAN);
    T ss = fold_thread_share(T(0), v, n, [m](T a, T x, int64_t) { return a + (x - m) * (x - m); });
    ss = block_combine(ss, fn::Add{});
    if (threadIdx.x == 0) {
      const double res = static_cast<double>(ss) / divisor;
      out[r] = static_cast<T>(take_sqrt ? std::sqrt(res) : res);
    }
  }
}

// ---- norms, accumulated in f64 ----

enum class NormKind : int { inf, one, two, p };

// The norm of v[0..n) by one block (every thread returns it; thread 0's
// is written): the one formula norm_kernel and norm_n_kernel share, so a
// tensor's norm has the same bits from either.
template <class T>
__device__ double block_norm(const T* v, int64_t n, NormKind kind, double p) {
  double acc = 0;
  if (kind == NormKind::inf) {
    // The max of |x| with NaN winning, as the CPU's loop stops at a NaN.
    acc = fold_thread_share(acc, v, n, [](double a, T x, int64_t) {
      return fn::Maximum{}(a, std::abs(static_cast<double>(x)));
    });
    return block_combine(acc, fn::Maximum{});
  }
  acc = fold_thread_share(acc, v, n, [kind, p](double s, T x, int64_t) {
    const double a = static_cast<double>(x);
    return s + (kind == NormKind::one   ? std::abs(a)
                : kind == NormKind::two ? a * a
                                        : std::pow(std::abs(a), p));
  });
  acc = block_combine(acc, fn::Add{});
  if (kind == NormKind::two) acc = std::sqrt(acc);
  if (kind == NormKind::p) acc = std::pow(acc, 1.0 / p);
  return acc;
}

template <class T>
__global__ void norm_kernel(const T* in, int64_t outer, int64_t n, NormKind kind, double p,
                            T* out) {
  for (int64_t r = blockIdx.x; r < outer; r += gridDim.x) {
    const double acc = block_norm(in + r * n, n, kind, p);
    if (threadIdx.x == 0) out[r] = static_cast<T>(acc);
  }
}

// Tensors per norm_n launch (1 KB of kernel argument).
constexpr int kNormChunk = 64;

template <class T>
struct NormChunk {
  const T* x[kNormChunk];
  int64_t n[kNormChunk];
};

// Block b writes the norm of the chunk's tensor b to out[b] (0 for an empty
// one): norm_kernel's block and formula, one tensor a block.
template <class T>
__global__ void norm_n_kernel(NormChunk<T> c, NormKind kind, double p, double* out) {
  const int t = static_cast<int>(blockIdx.x);
  const double acc = block_norm(c.x[t], c.n[t], kind, p);
  if (threadIdx.x == 0) out[t] = static_cast<double>(static_cast<T>(acc));
}

NormKind norm_kind(double p) {
  return std::isinf(p) ? NormKind::inf
         : p == 1.0    ? NormKind::one
         : p == 2.0    ? NormKind::two
                       : NormKind::p;
}

// ---- cumsum ----

// inner == 1: a block scans each row in tiles of blockDim elements, carrying
// the running total from tile to tile.
template <class T>
__global__ void cumsum_rows_kernel(const T* in, int64_t outer, int64_t n, bool reverse, T* out) {
  using Scan = cub::BlockScan<T, kThreadsPerBlock>;
  __shared__ typename Scan::TempStorage tmp;
  for (int64_t r = blockIdx.x; r < outer; r += gridDim.x) {
    const T* s = in + r * n;
    T* t = out + r * n;
    T carry = T(0);
    for (int64_t base = 0; base < n; base += blockDim.x) {
      const int64_t i = base + threadIdx.x;
      const int64_t j = reverse ? n - 1 - i : i;
      T y, tile;
      Scan(tmp).InclusiveSum(i < n ? s[j] : T(0), y, tile);
      if (i < n) t[j] = static_cast<T>(carry + y);
      carry = static_cast<T>(carry + tile);
      __syncthreads();  // tmp is reused by the next tile
    }
  }
}

// inner > 1: one thread per (outer, column) line, in the CPU's order.
template <class T>
__global__ void cumsum_lines_kernel(const T* in, int64_t outer, int64_t n, int64_t inner,
                                    bool reverse, T* out) {
  const int64_t lines = outer * inner;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < lines;
       e += step) {
    const int64_t o = e / inner, k = e % inner;
    const T* s = in + o * n * inner + k;
    T* t = out + o * n * inner + k;
    const int64_t first = reverse ? n - 1 : 0, dir = reverse ? -1 : 1;
    T acc = s[first * inner];
    t[first * inner] = acc;
    for (int64_t i = first + dir; i >= 0 && i < n; i += dir) {
      acc = static_cast<T>(acc + s[i * inner]);
      t[i * inner] = acc;
    }
  }
}

// ---- softmax ----

// inner == 1: a block per row: max, sum of exponentials, write.
template <bool Log, class T>
__global__ void softmax_rows_kernel(const T* in, int64_t outer, int64_t n, T* out) {
  for (int64_t r = blockIdx.x; r < outer; r += gridDim.x) {
    const T* a = in + r * n;
    T* b = out + r * n;
    const T m = block_row_max(a, n);
    const T s = block_row_sum_exp(a, n, m);
    if constexpr (Log) {
      const T shift = m + std::log(s);
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) b[i] = a[i] - shift;
    } else {
      const T inv = T(1) / s;
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) b[i] = std::exp(a[i] - m) * inv;
    }
  }
}

// inner > 1: one thread per (outer, column) line, the CPU's strided loop.
template <bool Log, class T>
__global__ void softmax_lines_kernel(const T* in, int64_t outer, int64_t n, int64_t inner, T* out) {
  const int64_t lines = outer * inner;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < lines;
       e += step) {
    const int64_t o = e / inner, k = e % inner;
    const T* a = in + o * n * inner + k;
    T* b = out + o * n * inner + k;
    T m = T(-INFINITY), s = T(0);
    for (int64_t i = 0; i < n; ++i) m = m < a[i * inner] ? a[i * inner] : m;  // std::max
    for (int64_t i = 0; i < n; ++i) {
      const T x = std::exp(a[i * inner] - m);
      s += x;
      if constexpr (!Log) b[i * inner] = x;
    }
    if constexpr (Log) {
      m += std::log(s);
      for (int64_t i = 0; i < n; ++i) b[i * inner] = a[i * inner] - m;
    } else {
      s = T(1) / s;
      for (int64_t i = 0; i < n; ++i) b[i * inner] *= s;
    }
  }
}

template <bool IsMax>
void extreme_rows(DType dtype, const void* rows, int64_t outer, int64_t inner, int64_t* indices,
                  void* values) {
  if (outer == 0) return;
  if (inner == 0) throw std::logic_error("[index_rows] empty rows reached the kernel");
  dispatch_numeric(dtype, IsMax ? "max" : "min", [&](auto tag) {
    using T = typename decltype(tag)::type;
    extreme_kernel<IsMax, T><<<row_blocks(outer), kThreadsPerBlock, 0, stream()>>>(
        static_cast<const T*>(rows), outer, inner, indices, static_cast<T*>(values));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

// ---- row reductions: a block per row (CUB's block reduction); long rows
// are first cut into chunks summed into a partials buffer, then reduced
// again, so few long rows still fill the device. Deterministic: a fixed
// split and a fixed order within each block. ----

template <class T, class Acc>
__global__ void chunk_sum_kernel(const T* in, int64_t rows, int64_t inner, int64_t parts,
                                 Acc* out) {
  using Reduce = cub::BlockReduce<Acc, kThreadsPerBlock>;
  __shared__ typename Reduce::TempStorage tmp;
  const int64_t len = (inner + parts - 1) / parts;
  for (int64_t job = blockIdx.x; job < rows * parts; job += gridDim.x) {
    const int64_t row = job / parts, part = job % parts;
    const int64_t lo = part * len, hi = min(inner, lo + len);
    const Acc s = fold_thread_share(Acc(0), in + row * inner + lo, hi - lo,
                                    [](Acc a, T x, int64_t) { return a + static_cast<Acc>(x); });
    const Acc total = Reduce(tmp).Sum(s);
    if (threadIdx.x == 0) out[job] = total;
    __syncthreads();  // tmp is reused by the next job
  }
}

template <class T, class Acc>
void sum_rows(const T* in, int64_t outer, int64_t inner, Acc* out) {
  const int64_t blocks = max_blocks();
  int64_t parts = 1;
  // Split only when the rows alone leave most of the device idle.
  if (outer < blocks && inner > 16 * kThreadsPerBlock)
    parts = std::min<int64_t>((blocks + outer - 1) / outer, inner / (4 * kThreadsPerBlock));
  if (parts <= 1) {
    chunk_sum_kernel<T, Acc>
        <<<static_cast<unsigned>(std::min(outer, blocks)), kThreadsPerBlock, 0, stream()>>>(
            in, outer, inner, 1, out);
    QUANTA_CUDA_CHECK_LAUNCH();
    return;
  }
  Acc* partial = nullptr;
  QUANTA_CUDA_CHECK(cudaMallocAsync(&partial, sizeof(Acc) * outer * parts, stream()));
  chunk_sum_kernel<T, Acc>
      <<<static_cast<unsigned>(std::min(outer * parts, blocks)), kThreadsPerBlock, 0, stream()>>>(
          in, outer, inner, parts, partial);
  QUANTA_CUDA_CHECK_LAUNCH();
  chunk_sum_kernel<Acc, Acc>
      <<<static_cast<unsigned>(std::min(outer, blocks)), kThreadsPerBlock, 0, stream()>>>(
          partial, outer, parts, 1, out);
  QUANTA_CUDA_CHECK_LAUNCH();
  QUANTA_CUDA_CHECK(cudaFreeAsync(partial, stream()));
}

// ---- grid reductions: [outer, a, keep, b] over a and b, read in place ----

// One thread per output (o, k) and piece p of a, folding i in its piece and
// j in order into out[(o * pieces + p) * keep + k]: a warp's threads take
// neighbouring k, so for b == 1 (a column reduction) each i is one coalesced
// read of a row.
template <class T, class Acc, class Out, class Fold>
__global__ void grid_fold_kernel(const T* src, int64_t outer, int64_t a, int64_t keep, int64_t b,
                                 int64_t piece, int64_t pieces, Fold fold, Out* out) {
  const int64_t n = outer * pieces * keep;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += step) {
    const int64_t k = e % keep, p = e / keep % pieces, o = e / keep / pieces;
    const int64_t i1 = min(a, (p + 1) * piece);
    Acc acc = Fold::template start<Acc>();
    if (b == 1) {  // a column: its values a row apart, several loads in flight
      acc = fn::fold_strided(acc, src + (o * a + p * piece) * keep + k, i1 - p * piece, keep, fold);
    } else {
      for (int64_t i = p * piece; i < i1; ++i) {
        const T* v = src + ((o * a + i) * keep + k) * b;
        for (int64_t j = 0; j < b; ++j) acc = fold(acc, static_cast<Acc>(v[j]));
      }
    }
    out[e] = static_cast<Out>(acc);
  }
}

// b >= kGridBlockB (NCHW over N, H and W): one block per output, its threads
// striding over the a * b values in memory order, combined by CUB.
constexpr int64_t kGridBlockB = 32;
// A cut reduction's second pass, over its pieces: a block per output from
// this many pieces on, else a thread per output.
constexpr int64_t kBlockFoldPieces = 64;

template <class T, class Acc, class Out, class Fold>
__global__ void grid_block_kernel(const T* src, int64_t outer, int64_t a, int64_t keep, int64_t b,
                                  Fold fold, Out* out) {
  for (int64_t r = blockIdx.x; r < outer * keep; r += gridDim.x) {
    const int64_t o = r / keep, k = r % keep;
    Acc acc = Fold::template start<Acc>();
    acc = fn::fold_pairs(
        acc, threadIdx.x, blockDim.x, a, b,
        [&](int64_t i, int64_t j) { return src[((o * a + i) * keep + k) * b + j]; },
        [&](Acc x, T v) { return fold(x, static_cast<Acc>(v)); });
    acc = block_combine(acc, fold);
    if (threadIdx.x == 0) out[r] = static_cast<Out>(acc);
  }
}

// The grid reduction of src (T) into out (Out) through accumulators of Acc.
template <class T, class Acc, class Out, class Fold>
void fold_grid(const void* src, const ReduceGrid& g, Fold fold, void* out) {
  const T* in = static_cast<const T*>(src);
  Out* o = static_cast<Out*>(out);
  const int64_t outputs = g.outer * g.keep;
  if (outputs == 0) return;
  if (g.b >= kGridBlockB) {
    grid_block_kernel<T, Acc, Out><<<row_blocks(outputs), kThreadsPerBlock, 0, stream()>>>(
        in, g.outer, g.a, g.keep, g.b, fold, o);
    QUANTA_CUDA_CHECK_LAUNCH();
    return;
  }
  const GridPieces cut = grid_pieces(outputs, g.a);
  if (cut.pieces == 1) {
    const LaunchConfig cfg = launch_config(outputs, max_blocks());
    grid_fold_kernel<T, Acc, Out><<<static_cast<unsigned>(cfg.blocks), cfg.threads, 0, stream()>>>(
        in, g.outer, g.a, g.keep, g.b, cut.piece, 1, fold, o);
    QUANTA_CUDA_CHECK_LAUNCH();
    return;
  }
  // The pieces' results [outer, pieces, keep], then their fold over pieces.
  Acc* partial = nullptr;
  QUANTA_CUDA_CHECK(cudaMallocAsync(&partial, sizeof(Acc) * outputs * cut.pieces, stream()));
  const LaunchConfig first = launch_config(outputs * cut.pieces, max_blocks());
  grid_fold_kernel<T, Acc, Acc>
      <<<static_cast<unsigned>(first.blocks), first.threads, 0, stream()>>>(
          in, g.outer, g.a, g.keep, g.b, cut.piece, cut.pieces, fold, partial);
  QUANTA_CUDA_CHECK_LAUNCH();
  // Few outputs are what made many pieces (a column of a million rows is
  // 31250 of them): one thread each would fold them one dependent load at a
  // time, so from kBlockFoldPieces on a block folds each output's pieces.
  if (cut.pieces >= kBlockFoldPieces) {
    grid_block_kernel<Acc, Acc, Out><<<row_blocks(outputs), kThreadsPerBlock, 0, stream()>>>(
        partial, g.outer, cut.pieces, g.keep, 1, fold, o);
  } else {
    const LaunchConfig second = launch_config(outputs, max_blocks());
    grid_fold_kernel<Acc, Acc, Out>
        <<<static_cast<unsigned>(second.blocks), second.threads, 0, stream()>>>(
            partial, g.outer, cut.pieces, g.keep, 1, cut.pieces, 1, fold, o);
  }
  QUANTA_CUDA_CHECK_LAUNCH();
  QUANTA_CUDA_CHECK(cudaFreeAsync(partial, stream()));
}

// 16-bit input (the table's half_reductions): sum, max and min in f32 into
// f32 outputs, through the grid folds (a row reduction's max and min are the
// grid {outer, 1, 1, inner}: a block per row when rows are long).
template <class H>
void half_grid(RowReduce op, const void* src, const ReduceGrid& g, void* out) {
  if (!fn::reduces_half(op))
    throw std::logic_error(std::string("[") + op_name(op) + "] 16-bit input reached the kernel");
  fn::visit_fold(op, [&](auto fold) { fold_grid<H, float, float>(src, g, fold, out); });
}

}  // namespace

void reduce_rows(RowReduce op, DType in_dtype, const void* rows, int64_t outer, int64_t inner,
                 void* out) {
  if (outer == 0) return;
  // 16-bit sums go through the row sums (which cut long rows into parts),
  // max and min through the grid folds.
  if (visit_half(in_dtype, [&](auto tag) {
        using H = typename decltype(tag)::type;
        if (op == RowReduce::sum)
          sum_rows<H, float>(static_cast<const H*>(rows), outer, inner, static_cast<float*>(out));
        else
          half_grid<H>(op, rows, ReduceGrid{outer, 1, 1, inner}, out);
      }))
    return;
  const unsigned blocks = row_blocks(outer);
  switch (op) {
    case RowReduce::sum:
      return dispatch_all(in_dtype, "sum", [&](auto tag) {
        using T = typename decltype(tag)::type;
        if constexpr (is_half_v<T>) {
          throw std::logic_error("[sum] 16-bit input reached the kernel");
        } else {
          using Acc = std::conditional_t<std::is_floating_point_v<T>, T, int64_t>;
          sum_rows<T, Acc>(static_cast<const T*>(rows), outer, inner, static_cast<Acc*>(out));
        }
      });
    case RowReduce::prod:
      return dispatch_numeric(in_dtype, "prod", [&](auto tag) {
        using T = typename decltype(tag)::type;
        // Integers multiply as unsigned: overflow wraps, as on the CPU.
        using Acc = std::conditional_t<std::is_integral_v<T>, unsigned long long, T>;
        prod_kernel<T, Acc><<<blocks, kThreadsPerBlock, 0, stream()>>>(
            static_cast<const T*>(rows), outer, inner, static_cast<T*>(out));
        QUANTA_CUDA_CHECK_LAUNCH();
      });
    case RowReduce::max:
      return extreme_rows<true>(in_dtype, rows, outer, inner, nullptr, out);
    case RowReduce::min:
      return extreme_rows<false>(in_dtype, rows, outer, inner, nullptr, out);
    case RowReduce::all:
    case RowReduce::any: {
      if (in_dtype != DType::boolean) bad_dtype(op_name(op), in_dtype, "expected bool");
      const bool* in = static_cast<const bool*>(rows);
      bool* o = static_cast<bool*>(out);
      if (op == RowReduce::all) {
        bool_kernel<true><<<blocks, kThreadsPerBlock, 0, stream()>>>(in, outer, inner, o);
      } else {
        bool_kernel<false><<<blocks, kThreadsPerBlock, 0, stream()>>>(in, outer, inner, o);
      }
      QUANTA_CUDA_CHECK_LAUNCH();
      return;
    }
    case RowReduce::logsumexp:
      return dispatch_float(in_dtype, "logsumexp", [&](auto tag) {
        using T = typename decltype(tag)::type;
        logsumexp_kernel<T><<<blocks, kThreadsPerBlock, 0, stream()>>>(
            static_cast<const T*>(rows), outer, inner, static_cast<T*>(out));
        QUANTA_CUDA_CHECK_LAUNCH();
      });
  }
  throw std::logic_error("[reduce_rows] unknown row reduction");
}

void reduce_grid(RowReduce op, DType in_dtype, const void* src, const ReduceGrid& grid, void* out) {
  if (visit_half(in_dtype,
                 [&](auto tag) { half_grid<typename decltype(tag)::type>(op, src, grid, out); }))
    return;
  switch (op) {
    case RowReduce::sum:
      return dispatch_all(in_dtype, "sum", [&](auto tag) {
        using T = typename decltype(tag)::type;
        if constexpr (is_half_v<T>) {
          throw std::logic_error("[sum] 16-bit input reached the kernel");
        } else {
          using Acc = std::conditional_t<std::is_floating_point_v<T>, T, int64_t>;
          fold_grid<T, Acc, Acc>(src, grid, fn::FoldSum{}, out);
        }
      });
    case RowReduce::prod:
      return dispatch_numeric(in_dtype, "prod", [&](auto tag) {
        using T = typename decltype(tag)::type;
        // Integers multiply as unsigned: overflow wraps, as on the CPU.
        using Acc = std::conditional_t<std::is_integral_v<T>, unsigned long long, T>;
        fold_grid<T, Acc, T>(src, grid, fn::FoldProd{}, out);
      });
    case RowReduce::max:
    case RowReduce::min:
      return dispatch_numeric(in_dtype, op_name(op), [&](auto tag) {
        using T = typename decltype(tag)::type;
        if (op == RowReduce::max)
          fold_grid<T, T, T>(src, grid, fn::FoldExtreme<true>{}, out);
        else
          fold_grid<T, T, T>(src, grid, fn::FoldExtreme<false>{}, out);
      });
    case RowReduce::all:
    case RowReduce::any:
      if (in_dtype != DType::boolean) bad_dtype(op_name(op), in_dtype, "expected bool");
      if (op == RowReduce::all)
        return fold_grid<bool, bool, bool>(src, grid, fn::FoldBool<true>{}, out);
      return fold_grid<bool, bool, bool>(src, grid, fn::FoldBool<false>{}, out);
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
  if (outer == 0) return;
  const unsigned blocks = row_blocks(outer);
  dispatch_float(dtype, op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* in = static_cast<const T*>(rows);
    T* o = static_cast<T*>(out);
    if (op == RowStat::norm) {
      norm_kernel<T>
          <<<blocks, kThreadsPerBlock, 0, stream()>>>(in, outer, inner, norm_kind(param), param, o);
    } else {
      moment_kernel<T><<<blocks, kThreadsPerBlock, 0, stream()>>>(in, outer, inner, param,
                                                                  op == RowStat::std, o);
    }
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

void norm_n(DType dtype, double p, const TensorSpanList& tensors, double* out) {
  dispatch_float(dtype, "clip_grad_norm_", [&](auto tag) {
    using T = typename decltype(tag)::type;
    for (int64_t first = 0; first < tensors.count; first += kNormChunk) {
      NormChunk<T> c{};
      const int rows = static_cast<int>(std::min<int64_t>(kNormChunk, tensors.count - first));
      for (int i = 0; i < rows; ++i) {
        c.x[i] = static_cast<const T*>(tensors.data[first + i].data);
        c.n[i] = tensors.data[first + i].n;
      }
      norm_n_kernel<T><<<static_cast<unsigned>(rows), kThreadsPerBlock, 0, stream()>>>(
          c, norm_kind(p), p, out + first);
      QUANTA_CUDA_CHECK_LAUNCH();
    }
  });
}

void cumsum(DType dtype, const void* in, int64_t outer, int64_t n, int64_t inner, bool reverse,
            void* out) {
  if (outer * n * inner == 0) return;
  dispatch_numeric(dtype, "cumsum", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* s = static_cast<const T*>(in);
    T* t = static_cast<T*>(out);
    if (inner == 1) {
      cumsum_rows_kernel<T>
          <<<row_blocks(outer), kThreadsPerBlock, 0, stream()>>>(s, outer, n, reverse, t);
    } else {
      const LaunchConfig cfg = launch_config(outer * inner, max_blocks());
      cumsum_lines_kernel<T><<<static_cast<unsigned>(cfg.blocks), cfg.threads, 0, stream()>>>(
          s, outer, n, inner, reverse, t);
    }
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

void softmax(bool log, DType dtype, const void* in, int64_t outer, int64_t n, int64_t inner,
             void* out) {
  if (outer * n * inner == 0) return;
  dispatch_float(dtype, log ? "log_softmax" : "softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* a = static_cast<const T*>(in);
    T* b = static_cast<T*>(out);
    if (inner == 1) {
      const unsigned blocks = row_blocks(outer);
      if (log) {
        softmax_rows_kernel<true, T><<<blocks, kThreadsPerBlock, 0, stream()>>>(a, outer, n, b);
      } else {
        softmax_rows_kernel<false, T><<<blocks, kThreadsPerBlock, 0, stream()>>>(a, outer, n, b);
      }
    } else {
      const LaunchConfig cfg = launch_config(outer * inner, max_blocks());
      const unsigned blocks = static_cast<unsigned>(cfg.blocks);
      if (log) {
        softmax_lines_kernel<true, T><<<blocks, cfg.threads, 0, stream()>>>(a, outer, n, inner, b);
      } else {
        softmax_lines_kernel<false, T><<<blocks, cfg.threads, 0, stream()>>>(a, outer, n, inner, b);
      }
    }
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace quanta::cuda
