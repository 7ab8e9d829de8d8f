// The CPU quantizer table: every fast path's CPU entry in one place.
#include "quant/cpu/kernels.h"

namespace quanta::quant::quant_cpu {

const QuantKernelTable& table() {
  static const QuantKernelTable t{
      .device_name = "cpu",
      .nearest_codes = nearest_codes,
      .squared_error = squared_error,
      .squared_error_grad = squared_error_grad,
      .route_grad = route_grad,
      .put_rows = put_rows,
      .code_statistics = code_statistics,
      .bit_product = bit_product,
      .bit_product_grad = bit_product_grad,
      .clamped_entropy = clamped_entropy,
      .nf4_absmax = nf4_absmax,
      .nf4_encode = nf4_encode,
      .nf4_decode = nf4_decode,
      .nf4_linear = nf4_linear,
      .nf4_linear_grad = nf4_linear_grad,
  };
  return t;
}

}  // namespace quanta::quant::quant_cpu
