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

// Rows per block. Each GEMM call repacks the whole codebook, so blocks are
// as tall as a tile budget of 2^21 floats (8 MiB) allows, but no taller than
// one block per thread, and at least 16 rows.
int64_t block_rows(int64_t n, int64_t k) {
  const int64_t budget = std::max<int64_t>(16, (int64_t(1) << 21) / std::max<int64_t>(k, 1));
  const int64_t per_thread = (n + num_threads() - 1) / std::max(1, num_threads());
  return std::max<int64_t>(16, std::min({budget, per_thread, int64_t(1024)}));
}

// Index of the smallest bias[j] - 2 row[j], the first on ties: the scores
// are formed in place and reduced with Eigen's vectorised minCoeff, then the
// first position holding the minimum is found with a plain scan.
template <class T>
int64_t row_argmin(T* row, const T* bias, int64_t k) {
  using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
  Eigen::Map<Arr> r(row, k);
  r = Eigen::Map<const Arr>(bias, k) - T(2) * r;
  const T m = r.minCoeff();
  for (int64_t j = 0; j < k; ++j)
    if (row[j] == m) return j;
  return 0;  // only NaN scores: no code is nearer than another
}

template <class T>
void nearest_kernel(const T* x, const T* c, int64_t n, int64_t k, int64_t d, bool cosine,
                    int64_t* out) {
  // Score |c|^2 - 2 x.c (the per-row |x|^2 does not change which code is
  // nearest); cosine: 0 - 2 x.c, i.e. the largest similarity.
  std::vector<T> cn(static_cast<size_t>(k), T(0));
  if (!cosine)
    for (int64_t j = 0; j < k; ++j) {
      T s = 0;
      for (int64_t e = 0; e < d; ++e) s += c[j * d + e] * c[j * d + e];
      cn[j] = s;
    }
  const T* bias = cn.data();
  const int64_t kBlock = block_rows(n, k);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  cpu::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<T> tile(static_cast<size_t>(std::min(kBlock, n) * k));
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t r0 = b * kBlock, rows = std::min(kBlock, n - r0);
      // tile = x_block c^T: c [K, D] read as a column-major [D, K] matrix.
      cpu::gemm<T>(rows, k, d, {x + r0 * d, d, 1}, {c, 1, d}, tile.data(), k);
      for (int64_t i = 0; i < rows; ++i) out[r0 + i] = row_argmin(tile.data() + i * k, bias, k);
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
