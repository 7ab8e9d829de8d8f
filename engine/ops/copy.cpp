// Copies and casts: copy_, fill_, contiguous, to_dtype.
#include "engine/autograd/grad_mode.h"
#include "engine/autograd/node.h"
#include "engine/dispatch.h"
#include "engine/kernels/table.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/view.h"

namespace quanta {
namespace detail {
void check_inplace(const char* op, const Tensor& dst) {
  if (dst.defined() && dst.storage() && dst.storage()->shared_constant())
    throw std::invalid_argument(std::string("[") + op +
                                "] in-place update of a shared constant (constant_tensor, "
                                "shared_full, constant_like): every user of it would see the "
                                "change; write into a copy (clone) instead");
  if (grad_enabled() && dst.requires_grad())
    throw std::invalid_argument(std::string("[") + op +
                                "] in-place update of a tensor that requires grad; run it "
                                "under NoGradGuard (as optimisers do)");
}
}  // namespace detail

void copy_(const Tensor& dst, const Tensor& src) {
  detail::check_inplace("copy_", dst);
  if (dst.device() != src.device()) {
    if (dst.dtype() != src.dtype() || dst.shape() != src.shape() || !dst.is_contiguous())
      throw std::invalid_argument(
          "[copy_] across devices needs equal dtype and shape and a "
          "contiguous destination");
    Tensor s = src.contiguous();
    copy_bytes(dst.raw_data(), dst.device(), s.raw_data(), s.device(), s.nbytes());
    return;
  }
  if (!dtype_info(dst.dtype()).arithmetic || !dtype_info(src.dtype()).arithmetic) {
    if (dst.dtype() != src.dtype() || dst.shape() != src.shape() || !dst.is_contiguous() ||
        !src.is_contiguous())
      throw std::invalid_argument(std::string("[copy_] dtype ") + dtype_name(src.dtype()) +
                                  " is byte-only: copies need equal dtype and shape");
    copy_bytes(dst.raw_data(), dst.device(), src.raw_data(), src.device(), src.nbytes());
    return;
  }
  Tensor s = src.shape() == dst.shape() ? src : expand(src.detach(), dst.shape());
  kernels(dst.device()).copy(dst.shape(), operand_of(dst), operand_of(s));
}

void fill_(const Tensor& dst, double value) {
  detail::check_inplace("fill_", dst);
  kernels(dst.device()).fill(dst.shape(), operand_of(dst), value);
}

Tensor contiguous(const Tensor& x) {
  if (x.is_contiguous()) return x;
  Tensor out = detail::make_tensor(x.shape(), x.dtype(), x.device());
  {
    NoGradGuard no_grad;
    copy_(out, x);
  }
  return autograd::record("contiguous", out, {x},
                          [](const Tensor& g) { return std::vector<Tensor>{g}; });
}

Tensor to_dtype(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  check_arithmetic("to_dtype", {x.dtype(), dtype});
  Tensor out = detail::make_tensor(x.shape(), dtype, x.device());
  {
    NoGradGuard no_grad;
    copy_(out, x);
  }
  if (!is_floating(dtype)) return out;
  return autograd::record("to_dtype", out, {x}, [from = x.dtype()](const Tensor& g) {
    return std::vector<Tensor>{to_dtype(g, from)};
  });
}

}  // namespace quanta
