#include "quant/vq/code_statistics.h"

#include <stdexcept>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/ops/index.h"
#include "engine/ops/view.h"
#include "quant/kernels/table.h"

namespace quanta::quant {

CodeStatistics code_statistics(const Tensor& idx, const Tensor& x, int64_t k) {
  const QuantKernelTable& kernels = quant_kernels_for("code_statistics", {&idx, &x});
  if (x.dim() != 2 || idx.dim() != 1 || idx.size(0) != x.size(0))
    throw std::invalid_argument("[code_statistics] needs idx [N] and x [N, D], got " +
                                shape_str(idx.shape()) + " and " + shape_str(x.shape()));
  if (idx.dtype() != DType::i64 && idx.dtype() != DType::i32)
    throw std::invalid_argument(std::string("[code_statistics] idx must be i64 or i32, got ") +
                                dtype_name(idx.dtype()));
  if (!is_floating(x.dtype()))
    throw std::invalid_argument(std::string("[code_statistics] x must be floating, got ") +
                                dtype_name(x.dtype()));
  if (k < 0)
    throw std::invalid_argument("[code_statistics] k must be >= 0: got " + std::to_string(k));
  NoGradGuard no_grad;
  const int64_t n = x.size(0), d = x.size(1);
  const TensorOptions opt{.dtype = x.dtype(), .device = x.device()};
  if (x.dtype() != DType::f32 && x.dtype() != DType::f64)
    return {index_add(zeros({k}, opt), 0, idx, shared_full({n}, 1.0, opt)),
            index_add(zeros({k, d}, opt), 0, idx, x.detach())};
  // Checked as the index ops check theirs: at once on the CPU, on a device
  // by the device (reported at the next read), never by reading it back.
  const Tensor ix =
      quanta::detail::checked_index("code_statistics", contiguous(idx.to(DType::i64)), 0, k);
  const Tensor xc = contiguous(x.detach());
  CodeStatistics s{empty({k}, opt), empty({k, d}, opt)};
  kernels.code_statistics(x.dtype(), static_cast<const int64_t*>(ix.raw_data()), xc.raw_data(), n,
                          k, d, s.counts.raw_data(), s.sums.raw_data());
  return s;
}

}  // namespace quanta::quant
