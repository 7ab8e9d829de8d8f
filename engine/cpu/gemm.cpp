#include "engine/cpu/gemm.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "engine/cpu/block_cache.h"
#include "engine/cpu/gemm_bf16.h"
#include "engine/cpu/kernels.h"
#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"
#include "engine/eigen.h"

#ifdef QUANTA_GEMM_OPENBLAS
#include <cblas.h>
#endif
#ifdef QUANTA_GEMM_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#endif

namespace quanta::cpu {
namespace {

enum Layout { kRowMajor, kColMajor, kNone };

// c[m, n] (row stride ldc) = 0, in parallel outside a parallel region.
template <class T>
void zero_rows(T* c, int64_t m, int64_t n, int64_t ldc) {
  if (ldc == n) {
    parallel_for(0, m * n, 1 << 18,
                 [&](int64_t lo, int64_t hi) { std::memset(c + lo, 0, sizeof(T) * (hi - lo)); });
    return;
  }
  parallel_for(0, m, std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(n, 1)),
               [&](int64_t lo, int64_t hi) {
                 for (int64_t i = lo; i < hi; ++i) std::memset(c + i * ldc, 0, sizeof(T) * n);
               });
}

// How a rows x cols matrix with strides (rs, cs) maps onto Eigen, and its
// outer stride. Degenerate dims (size <= 1) take any stride.
Layout layout_of(int64_t rows, int64_t cols, int64_t rs, int64_t cs, int64_t& outer) {
  if ((cs == 1 || cols <= 1) && (rows <= 1 || rs >= std::max<int64_t>(cols, 1))) {
    outer = rows <= 1 ? std::max<int64_t>(cols, 1) : rs;
    return kRowMajor;
  }
  if ((rs == 1 || rows <= 1) && (cols <= 1 || cs >= std::max<int64_t>(rows, 1))) {
    outer = cols <= 1 ? std::max<int64_t>(rows, 1) : cs;
    return kColMajor;
  }
  return kNone;
}

// One product on the calling thread through Eigen (built with
// EIGEN_DONT_PARALLELIZE, engine/eigen.h).
template <class T, int LA, int LB>
void eigen_product(int64_t m, int64_t n, int64_t k, const T* a, int64_t oa, const T* b, int64_t ob,
                   T* c, int64_t ldc, bool acc) {
  using Stride = Eigen::OuterStride<>;
  using MA = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, LA>;
  using MB = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, LB>;
  using MC = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Eigen::Map<const MA, 0, Stride> A(a, m, k, Stride(oa));
  Eigen::Map<const MB, 0, Stride> B(b, k, n, Stride(ob));
  Eigen::Map<MC, 0, Stride> C(c, m, n, Stride(m <= 1 ? std::max<int64_t>(n, 1) : ldc));
  // A vector side lets Eigen pick its matrix-vector kernel.
  if (m == 1) {
    auto row = C.row(0);
    if (acc)
      row.noalias() += A.row(0) * B;
    else
      row.noalias() = A.row(0) * B;
  } else if (n == 1) {
    auto col = C.col(0);
    if (acc)
      col.noalias() += A * B.col(0);
    else
      col.noalias() = A * B.col(0);
  } else {
    // Eigen's GEMM only accumulates: `C = A * B` zero-fills C on one thread
    // first. Zeroing here spreads that pass, and the first touch of a fresh
    // output's pages, over the threads.
    if (!acc) zero_rows(c, m, n, ldc);
    C.noalias() += A * B;
  }
}

// Multiply-adds below which a product stays on one thread (a block of rows
// per thread must outweigh starting the parallel region).
constexpr double kSplitMinWork = 1 << 17;

// Eigen's own threading waits for its threads by spinning, which a machine
// with other work turned into 4x slower training steps whatever
// OMP_WAIT_POLICY said (docs/performance.md, "Under load"). So Eigen runs on
// one thread, and a large product outside a parallel region is cut here into
// blocks of at least two rows, one per thread, each through Eigen's
// one-thread GEMM. (The bits then depend on the thread count, as they did
// with Eigen's threads: a block's rows fall into other register panels.)
template <class T, int LA, int LB>
void product(int64_t m, int64_t n, int64_t k, const T* a, int64_t oa, const T* b, int64_t ob, T* c,
             int64_t ldc, bool acc) {
  const double work = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  const int64_t blocks = std::min<int64_t>(num_threads(), m / 2);
  if (n < 2 || blocks < 2 || work < kSplitMinWork) {
    eigen_product<T, LA, LB>(m, n, k, a, oa, b, ob, c, ldc, acc);
    return;
  }
  const int64_t base = m / blocks, extra = m % blocks;
  parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t lo = i * base + std::min(i, extra), rows = base + (i < extra ? 1 : 0);
      // Row r of A starts at a + r * oa (row-major) or a + r (column-major).
      const T* a_rows = a + lo * (LA == Eigen::RowMajor ? oa : 1);
      eigen_product<T, LA, LB>(rows, n, k, a_rows, oa, b, ob, c + lo * ldc, ldc, acc);
    }
  });
}

#if defined(QUANTA_GEMM_OPENBLAS) || defined(QUANTA_GEMM_ONEDNN)
// BLAS-style interfaces check every leading dimension against the matrix it
// describes, even where a size of 1 makes the stride irrelevant.
template <int LA, int LB>
void valid_leading_dims(int64_t m, int64_t n, int64_t k, int64_t& oa, int64_t& ob, int64_t& ldc) {
  oa = std::max<int64_t>(oa, LA == Eigen::RowMajor ? k : m);
  ob = std::max<int64_t>(ob, LB == Eigen::RowMajor ? n : k);
  ldc = std::max<int64_t>(ldc, n);
}
#endif

#ifdef QUANTA_GEMM_OPENBLAS
// OpenBLAS when the loaded library is its OpenMP build: that one runs on
// quanta's OpenMP threads (one thread inside a parallel region). A pthreads
// build reached through Debian's alternatives would start a pool of its own
// that fights them, so quanta then keeps to Eigen.
bool openblas_usable() {
  static const bool usable = openblas_get_parallel() == 2;
  return usable;
}

void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k,
               const float* a, int64_t oa, const float* b, int64_t ob, float beta, float* c,
               int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, 1.0f, a, oa, b, ob, beta, c, ldc);
}
void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k,
               const double* a, int64_t oa, const double* b, int64_t ob, double beta, double* c,
               int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, 1.0, a, oa, b, ob, beta, c, ldc);
}

// The same product through OpenBLAS: a column-major operand is the
// transpose of a row-major one with the same outer stride.
template <class T, int LA, int LB>
void blas_product(int64_t m, int64_t n, int64_t k, const T* a, int64_t oa, const T* b, int64_t ob,
                  T* c, int64_t ldc, bool acc) {
  const CBLAS_TRANSPOSE ta = LA == Eigen::RowMajor ? CblasNoTrans : CblasTrans;
  const CBLAS_TRANSPOSE tb = LB == Eigen::RowMajor ? CblasNoTrans : CblasTrans;
  valid_leading_dims<LA, LB>(m, n, k, oa, ob, ldc);
  blas_gemm(ta, tb, m, n, k, a, oa, b, ob, acc ? T(1) : T(0), c, ldc);
}
#endif

#ifdef QUANTA_GEMM_ONEDNN
// oneDNN when the loaded library runs on OpenMP (Debian's does): like
// OpenBLAS's OpenMP build it shares quanta's threads, one thread inside a
// parallel region.
bool onednn_usable() {
  static const bool usable = dnnl_version()->cpu_runtime == DNNL_RUNTIME_OMP;
  return usable;
}

// The f32 product through oneDNN's sgemm (row-major, like cblas): its JIT
// takes the CPU's widest kernels from the CPU itself.
template <int LA, int LB>
void onednn_product(int64_t m, int64_t n, int64_t k, const float* a, int64_t oa, const float* b,
                    int64_t ob, float* c, int64_t ldc, bool acc) {
  valid_leading_dims<LA, LB>(m, n, k, oa, ob, ldc);
  const dnnl_status_t status =
      dnnl_sgemm(LA == Eigen::RowMajor ? 'N' : 'T', LB == Eigen::RowMajor ? 'N' : 'T', m, n, k,
                 1.0f, a, oa, b, ob, acc ? 1.0f : 0.0f, c, ldc);
  if (status != dnnl_success)
    throw std::runtime_error("[gemm] oneDNN's sgemm failed (status " + std::to_string(status) +
                             ") on " + std::to_string(m) + "x" + std::to_string(n) + "x" +
                             std::to_string(k));
}
#endif

template <class T>
using ProductFn = void (*)(int64_t, int64_t, int64_t, const T*, int64_t, const T*, int64_t, T*,
                           int64_t, bool);

// Below this many multiply-adds OpenBLAS's per-call cost (its buffer pool,
// packing) outweighs its faster kernel, and Eigen wins (a 32 x 196 x 16
// convolution GEMM ran 5-10x slower through OpenBLAS).
constexpr double kBlasMinWork = 1 << 20;

template <class T>
ProductFn<T> pick(Layout la, Layout lb, double work) {
#ifdef QUANTA_GEMM_ONEDNN
  if constexpr (std::is_same_v<T, float>) {
    if (work >= kBlasMinWork && onednn_usable()) {
      if (la == kRowMajor)
        return lb == kRowMajor ? &onednn_product<Eigen::RowMajor, Eigen::RowMajor>
                               : &onednn_product<Eigen::RowMajor, Eigen::ColMajor>;
      return lb == kRowMajor ? &onednn_product<Eigen::ColMajor, Eigen::RowMajor>
                             : &onednn_product<Eigen::ColMajor, Eigen::ColMajor>;
    }
  }
#endif
#ifdef QUANTA_GEMM_OPENBLAS
  if (work >= kBlasMinWork && openblas_usable()) {
    if (la == kRowMajor)
      return lb == kRowMajor ? &blas_product<T, Eigen::RowMajor, Eigen::RowMajor>
                             : &blas_product<T, Eigen::RowMajor, Eigen::ColMajor>;
    return lb == kRowMajor ? &blas_product<T, Eigen::ColMajor, Eigen::RowMajor>
                           : &blas_product<T, Eigen::ColMajor, Eigen::ColMajor>;
  }
#else
  (void)work;
#endif
  if (la == kRowMajor)
    return lb == kRowMajor ? &product<T, Eigen::RowMajor, Eigen::RowMajor>
                           : &product<T, Eigen::RowMajor, Eigen::ColMajor>;
  return lb == kRowMajor ? &product<T, Eigen::ColMajor, Eigen::RowMajor>
                         : &product<T, Eigen::ColMajor, Eigen::ColMajor>;
}

// A product narrower than this on any side is bound by reading its wide
// operand and writing its output, not by multiply-adds, so rounding its
// operands to bf16 costs more than the faster products save: LoRA's rank-16
// products ([2048, 1280] x [1280, 16] and its gradients) took 0.65-0.75 ms
// in bf16 against 0.41-0.43 ms in f32 from a cold cache; at rank 128 bf16
// won (1.34-1.47 against 1.64-1.73 ms); 32 and 64 were mixed.
constexpr int64_t kBf16MinSide = 64;

// Whether an f32 product asked for bf16 products gets them: the CPU's bf16
// instructions, enough work to repay rounding both operands, and no narrow
// side.
bool takes_bf16(bool bf16_products, int64_t m, int64_t n, int64_t k) {
  return bf16_products && double(m) * double(n) * double(k) >= kBlasMinWork &&
         std::min({m, n, k}) >= kBf16MinSide && bf16_gemm_native();
}

// MixedPrecision's f32 product: both operands rounded to bf16, f32 sums.
void bf16_product(int64_t m, int64_t n, int64_t k, MatRef<float> a, MatRef<float> b, float* c,
                  int64_t ldc, bool accumulate) {
  const ScratchBuffer ab(sizeof(bf16) * size_t(m * k)), bb(sizeof(bf16) * size_t(k * n));
  gemm_bf16(m, n, k, round_operand_to_bf16(m, k, a, ab.as<bf16>()),
            round_operand_to_bf16(k, n, b, bb.as<bf16>()), c, ldc, accumulate);
}

}  // namespace

GemmLayout gemm_layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  GemmLayout l;
  const Layout layout = layout_of(rows, cols, rs, cs, l.outer);
  l.maps = layout != kNone;
  l.row_major = layout == kRowMajor;
  return l;
}

bool gemm_maps(int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  return gemm_layout(rows, cols, rs, cs).maps;
}

template <class T>
void gemm(int64_t m, int64_t n, int64_t k, MatRef<T> a, MatRef<T> b, T* c, int64_t ldc,
          bool accumulate, bool bf16_products) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate) zero_rows(c, m, n, ldc);
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (takes_bf16(bf16_products, m, n, k)) {
      bf16_product(m, n, k, a, b, c, ldc, accumulate);
      return;
    }
  }
  int64_t oa = 0, ob = 0;
  const Layout la = layout_of(m, k, a.rs, a.cs, oa), lb = layout_of(k, n, b.rs, b.cs, ob);
  pick<T>(la, lb, double(m) * double(n) * double(k))(m, n, k, a.p, oa, b.p, ob, c, ldc, accumulate);
}

template <class T>
void gemm_batched(int64_t batch, int64_t m, int64_t n, int64_t k, MatRef<T> a, const int64_t* a_off,
                  MatRef<T> b, const int64_t* b_off, T* c, bool bf16_products) {
  if (batch == 0 || m == 0 || n == 0) return;
  if (k == 0) {
    std::memset(c, 0, sizeof(T) * batch * m * n);
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    // Products large enough for bf16 are large enough to thread one by one.
    if (takes_bf16(bf16_products, m, n, k)) {
      for (int64_t i = 0; i < batch; ++i)
        bf16_product(m, n, k, {a.p + a_off[i], a.rs, a.cs}, {b.p + b_off[i], b.rs, b.cs},
                     c + i * m * n, n, false);
      return;
    }
  }
  int64_t oa = 0, ob = 0;
  const Layout la = layout_of(m, k, a.rs, a.cs, oa), lb = layout_of(k, n, b.rs, b.cs, ob);
  const ProductFn<T> fn = pick<T>(la, lb, double(m) * double(n) * double(k));
  const int64_t mn = m * n;
  const double work = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  // Eigen threads one product well once it is large; below that, or when
  // there are at least as many products as threads, each thread takes whole
  // products (Eigen then stays single-threaded inside the parallel region).
  const int threads = num_threads();
  const bool by_batch = batch > 1 && threads > 1 && (batch >= threads || work < 128.0 * 128 * 128);
  if (by_batch) {
    const int64_t grain = std::max<int64_t>(1, static_cast<int64_t>(65536.0 / std::max(work, 1.0)));
    parallel_for(0, batch, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i)
        fn(m, n, k, a.p + a_off[i], oa, b.p + b_off[i], ob, c + i * mn, n, false);
    });
  } else {
    for (int64_t i = 0; i < batch; ++i)
      fn(m, n, k, a.p + a_off[i], oa, b.p + b_off[i], ob, c + i * mn, n, false);
  }
}

template void gemm<float>(int64_t, int64_t, int64_t, MatRef<float>, MatRef<float>, float*, int64_t,
                          bool, bool);
template void gemm<double>(int64_t, int64_t, int64_t, MatRef<double>, MatRef<double>, double*,
                           int64_t, bool, bool);
template void gemm_batched<float>(int64_t, int64_t, int64_t, int64_t, MatRef<float>, const int64_t*,
                                  MatRef<float>, const int64_t*, float*, bool);
template void gemm_batched<double>(int64_t, int64_t, int64_t, int64_t, MatRef<double>,
                                   const int64_t*, MatRef<double>, const int64_t*, double*, bool);

}  // namespace quanta::cpu

namespace quanta::cpu {
namespace {

// The rows x cols operand `a` widened to f32 into `out`, packed row-major.
MatRef<float> f32_operand(int64_t rows, int64_t cols, MatRef<bf16> a, const ScratchBuffer& out) {
  float* dst = out.as<float>();
  parallel_for(0, rows, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(cols, 1)),
               [&](int64_t lo, int64_t hi) {
                 for (int64_t i = lo; i < hi; ++i)
                   for (int64_t j = 0; j < cols; ++j)
                     dst[i * cols + j] = static_cast<float>(a.p[i * a.rs + j * a.cs]);
               });
  return {dst, std::max<int64_t>(cols, 1), 1};
}

// One bf16 product c[m, n] (row stride ldc, bf16) = a b, or += a b: f32
// sums in a scratch C, rounded into c once. Products large enough for
// oneDNN's bf16 matmul take the operands as they are; smaller ones widen
// them and run the f32 GEMM (a primitive per shape would cost more than
// the product).
void bf16_gemm_one(int64_t m, int64_t n, int64_t k, MatRef<bf16> a, MatRef<bf16> b, bf16* c,
                   int64_t ldc, bool accumulate) {
  const ScratchBuffer cs(sizeof(float) * size_t(m * n));
  float* cf = cs.as<float>();
  const auto rows = [&](auto&& row) {
    parallel_for(0, m, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(n, 1)),
                 [&](int64_t lo, int64_t hi) {
                   for (int64_t i = lo; i < hi; ++i) row(i);
                 });
  };
  if (accumulate)
    rows([&](int64_t i) {
      for (int64_t j = 0; j < n; ++j) cf[i * n + j] = static_cast<float>(c[i * ldc + j]);
    });
  if (double(m) * double(n) * double(k) >= kBlasMinWork) {
    gemm_bf16(m, n, k, a, b, cf, n, accumulate);
  } else {
    const ScratchBuffer as(sizeof(float) * size_t(m * k)), bs(sizeof(float) * size_t(k * n));
    gemm<float>(m, n, k, f32_operand(m, k, a, as), f32_operand(k, n, b, bs), cf, n, accumulate);
  }
  rows([&](int64_t i) { round_to_bf16(cf + i * n, n, c + i * ldc); });
}

// GemmArgs in bf16 (the table's gemm_bf16: the CPU has bf16 products).
void bf16_gemm(const GemmArgs& g) {
  const auto* a = static_cast<const bf16*>(g.a.data);
  const auto* b = static_cast<const bf16*>(g.b.data);
  auto* c = static_cast<bf16*>(g.c);
  if (g.batch > 1 && (g.accumulate || g.ldc != g.n))
    throw std::logic_error("[gemm] batched products write fresh contiguous outputs");
  for (int64_t i = 0; i < g.batch; ++i)
    bf16_gemm_one(g.m, g.n, g.k, {a + (g.a_off ? g.a_off[i] : 0), g.a.rs, g.a.cs},
                  {b + (g.b_off ? g.b_off[i] : 0), g.b.rs, g.b.cs}, c + i * g.m * g.n, g.ldc,
                  g.accumulate);
}

}  // namespace

void gemm(const GemmArgs& g) {
  if (g.dtype == DType::bf16 && bf16_gemm_native()) {
    if (g.batch > 0 && g.m > 0 && g.n > 0) bf16_gemm(g);
    return;
  }
  dispatch_float(g.dtype, "gemm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const MatRef<T> a{static_cast<const T*>(g.a.data), g.a.rs, g.a.cs};
    const MatRef<T> b{static_cast<const T*>(g.b.data), g.b.rs, g.b.cs};
    T* c = static_cast<T*>(g.c);
    if (g.batch == 1 && !g.a_off && !g.b_off) {
      gemm<T>(g.m, g.n, g.k, a, b, c, g.ldc, g.accumulate, g.bf16_products);
      return;
    }
    if (g.accumulate || g.ldc != g.n)
      throw std::logic_error("[gemm] batched products write fresh contiguous outputs");
    std::vector<int64_t> zeros;
    if (!g.a_off || !g.b_off) zeros.assign(static_cast<size_t>(g.batch), 0);
    gemm_batched<T>(g.batch, g.m, g.n, g.k, a, g.a_off ? g.a_off : zeros.data(), b,
                    g.b_off ? g.b_off : zeros.data(), c, g.bf16_products);
  });
}

}  // namespace quanta::cpu
