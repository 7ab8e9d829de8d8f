// CPU entry nearest_codes (quant/kernels/table.h): a tiled GEMM of the rows
// against the codebook, then each row's argmin, a block of rows at a time so
// memory beyond the inputs stays O(block x K), never O(N x K).
#include <algorithm>

#include "engine/cpu/gemm.h"
#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"
#include "engine/eigen.h"
#include "quant/cpu/kernels.h"
#include "quant/cpu/row_argmin.h"

namespace quanta::quant::quant_cpu {
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

void nearest_codes(DType dtype, const void* x, const void* codes, int64_t n, int64_t k, int64_t d,
                   bool cosine, int64_t* out) {
  dispatch_float(dtype, "nearest_codes", [&](auto tag) {
    using T = typename decltype(tag)::type;
    nearest_kernel<T>(static_cast<const T*>(x), static_cast<const T*>(codes), n, k, d, cosine, out);
  });
}

}  // namespace quanta::quant::quant_cpu
