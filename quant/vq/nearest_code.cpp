#include "quant/vq/nearest_code.h"

#include <Eigen/Core>
#include <algorithm>
#include <limits>
#include <stdexcept>
#include <vector>

#include "engine/autograd/grad_mode.h"
#include "engine/cpu/gemm.h"
#include "engine/cpu/parallel.h"
#include "engine/device_check.h"
#include "engine/dispatch.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/reductions.h"
#include "engine/ops/view.h"

namespace quanta::quant {
namespace {

// Rows per block: the block's score tile (rows x K) stays within 2^18
// floats (1 MiB), so filling it, accumulating the GEMM into it and scanning
// it for the minimum all happen in L2. At least 16 rows, and no more than
// one block per thread.
int64_t block_rows(int64_t n, int64_t k) {
  const int64_t budget = std::max<int64_t>(16, (int64_t(1) << 18) / std::max<int64_t>(k, 1));
  const int64_t per_thread = (n + num_threads() - 1) / std::max(1, num_threads());
  return std::max<int64_t>(16, std::min(budget, per_thread));
}

// Index of the smallest score in a row, the first on ties, in one pass:
// kLanes running minima with their indices (a strict < keeps each lane's
// first), then the lanes' minimum, the smallest index among equal ones.
// Written as lane arrays so the compiler turns the inner loop into vector
// compares and blends. NaN scores never win; a row of only NaN gives 0.
template <class T>
int64_t row_argmin(const T* row, int64_t k) {
  constexpr int kLanes = 64 / sizeof(T);
  T best[kLanes];
  int32_t at[kLanes];
  for (int l = 0; l < kLanes; ++l) best[l] = std::numeric_limits<T>::infinity(), at[l] = 0;
  int64_t j = 0;
  for (; j + kLanes <= k; j += kLanes)
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const T v = row[j + l];
      const bool lower = v < best[l];
      best[l] = lower ? v : best[l];
      at[l] = lower ? int32_t(j + l) : at[l];
    }
  T m = std::numeric_limits<T>::infinity();
  int64_t idx = 0;
  for (; j < k; ++j)  // the tail, in order
    if (row[j] < m) m = row[j], idx = j;
  for (int l = 0; l < kLanes; ++l)
    if (best[l] < m || (best[l] == m && at[l] < idx)) m = best[l], idx = at[l];
  return idx;
}

template <class T>
void nearest_kernel(const T* x, const T* c, int64_t n, int64_t k, int64_t d, bool cosine,
                    int64_t* out) {
  // Score |c|^2 - 2 x.c (the per-row |x|^2 does not change which code is
  // nearest); cosine: 0 - 2 x.c, i.e. the largest similarity. Each tile row
  // starts as the bias and the GEMM accumulates x (-2 c)^T onto it, so the
  // scores cost no pass of their own (scaling by -2 is exact).
  using Vec = Eigen::Matrix<T, Eigen::Dynamic, 1>;
  using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const Eigen::Map<const Mat> cm(c, k, d);
  Vec bias = Vec::Zero(k);
  if (!cosine)
    for (int64_t j = 0; j < k; ++j) {
      T sq = 0;
#pragma omp simd reduction(+ : sq)
      for (int64_t e = 0; e < d; ++e) sq += c[j * d + e] * c[j * d + e];
      bias[j] = sq;
    }
  const Mat neg2c = T(-2) * cm;
  const int64_t kBlock = block_rows(n, k);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  cpu::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    Mat tile(std::min(kBlock, n), k);
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t r0 = b * kBlock, rows = std::min(kBlock, n - r0);
      tile.topRows(rows).rowwise() = bias.transpose();
      // tile += x_block (-2c)^T: -2c [K, D] read as a column-major [D, K] matrix.
      cpu::gemm<T>(rows, k, d, {x + r0 * d, d, 1}, {neg2c.data(), 1, d}, tile.data(), k,
                   /*accumulate=*/true);
      for (int64_t i = 0; i < rows; ++i) out[r0 + i] = row_argmin(tile.data() + i * k, k);
    }
  });
}

}  // namespace

Tensor nearest_codes(const Tensor& x, const Tensor& codes, bool cosine) {
  detail::check_cpu("nearest_codes", {&x, &codes});
  if (x.dim() != 2 || codes.dim() != 2 || x.size(1) != codes.size(1))
    throw std::invalid_argument("[nearest_codes] needs x [N, D] and codes [K, D], got " +
                                shape_str(x.shape()) + " and " + shape_str(codes.shape()));
  const int64_t n = x.size(0), k = codes.size(0), d = x.size(1);
  Tensor out = zeros({n}, {.dtype = DType::i64});
  if (n == 0) return out;
  if (k == 0) throw std::invalid_argument("[nearest_codes] the codebook is empty");
  NoGradGuard no_grad;
  const DType dt = promote_types(x.dtype(), codes.dtype()) == DType::f64 ? DType::f64 : DType::f32;
  const Tensor xc = contiguous(to_dtype(x.detach(), dt));
  const Tensor cc = contiguous(to_dtype(codes.detach(), dt));
  dispatch_float(dt, "nearest_codes", [&](auto tag) {
    using T = typename decltype(tag)::type;
    nearest_kernel<T>(xc.data<T>(), cc.data<T>(), n, k, d, cosine, out.data<int64_t>());
  });
  return out;
}

Tensor l2norm(const Tensor& x, double eps) {
  const Tensor n = norm(x, 2.0, {-1}, true);
  return x / clamp(n, eps, std::numeric_limits<double>::quiet_NaN());
}

}  // namespace quanta::quant
