#include "quant/vq/nearest_code.h"

#include <limits>
#include <stdexcept>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/reductions.h"
#include "engine/ops/view.h"
#include "quant/kernels/table.h"

namespace quanta::quant {

Tensor nearest_codes(const Tensor& x, const Tensor& codes, bool cosine) {
  const QuantKernelTable& kernels = quant_kernels_for("nearest_codes", {&x, &codes});
  if (x.dim() != 2 || codes.dim() != 2 || x.size(1) != codes.size(1))
    throw std::invalid_argument("[nearest_codes] needs x [N, D] and codes [K, D], got " +
                                shape_str(x.shape()) + " and " + shape_str(codes.shape()));
  const int64_t n = x.size(0), k = codes.size(0), d = x.size(1);
  Tensor out = empty({n}, {.dtype = DType::i64, .device = x.device()});  // every row written
  if (n == 0) return out;
  if (k == 0) throw std::invalid_argument("[nearest_codes] the codebook is empty");
  NoGradGuard no_grad;
  const DType dt = promote_types(x.dtype(), codes.dtype()) == DType::f64 ? DType::f64 : DType::f32;
  const Tensor xc = contiguous(to_dtype(x.detach(), dt));
  const Tensor cc = contiguous(to_dtype(codes.detach(), dt));
  kernels.nearest_codes(dt, xc.raw_data(), cc.raw_data(), n, k, d, cosine,
                        static_cast<int64_t*>(out.raw_data()));
  return out;
}

Tensor l2norm(const Tensor& x, double eps) {
  const Tensor n = norm(x, 2.0, {-1}, true);
  return x / clamp(n, eps, std::numeric_limits<double>::quiet_NaN());
}

}  // namespace quanta::quant
