// The CUDA quantizer table, exported by the CUDA module as
// quanta_quant_cuda_table_v1 (libquanta finds it by name: quant/cuda/table.cpp).
#include "quant/cuda/kernels.h"

extern "C" __attribute__((visibility("default"))) const quanta::quant::QuantKernelTable*
quanta_quant_cuda_table_v1() {
  using namespace quanta::quant::quant_cuda;
  static const quanta::quant::QuantKernelTable t{
      .device_name = "cuda",
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
  return &t;
}
