// The CUDA quantizer table until its kernels land (issue 18): every entry
// throws naming its op. Compiled in CUDA and non-CUDA builds alike; the CUDA
// issue replaces this file with .cu files that fill the same table.
#include <stdexcept>
#include <string>

#include "quant/kernels/table.h"

namespace quanta::quant::quant_cuda {
namespace {

[[noreturn]] void no_kernel(const char* op) {
  throw std::runtime_error(std::string("[") + op +
                           "] has no CUDA kernel yet (issue 18); move the tensors to cpu");
}

}  // namespace

const QuantKernelTable& table() {
  static const QuantKernelTable t{
      .device_name = "cuda",
      .nearest_codes = [](DType, const void*, const void*, int64_t, int64_t, int64_t, bool,
                          int64_t*) { no_kernel("nearest_codes"); },
      .squared_error = [](DType, const void*, const void*, const uint8_t*, int64_t,
                          int64_t) -> SquaredErrorSum { no_kernel("commitment_loss"); },
      .squared_error_grad = [](DType, const void*, const void*, const uint8_t*, int64_t, int64_t,
                               double, void*) { no_kernel("commitment_loss backward"); },
      .route_grad =
          [](bool rotation, DType, const void*, const void*, const void*, const uint8_t*, double,
             int64_t, int64_t, void*) {
            no_kernel(rotation ? "rotate_to backward"
                               : "straight_through_with_commitment backward");
          },
      .put_rows = [](DType, void*, int64_t, const int64_t*, int64_t, const void*,
                     double) { no_kernel("Codebook"); },
      .bit_product = [](DType, const void*, int64_t, int64_t,
                        void*) { no_kernel("lfq_bit_product"); },
      .bit_product_grad = [](DType, const void*, const void*, int64_t, int64_t,
                             void*) { no_kernel("lfq_bit_product backward"); },
      .clamped_entropy = [](const double*, int64_t, int64_t, double*,
                            double*) { no_kernel("lfq_clamped_entropy"); },
      .nf4_absmax = [](const float*, int64_t, int64_t, float*) { no_kernel("quantize_nf4"); },
      .nf4_encode = [](const float*, int64_t, int64_t, const float*, const float*,
                       const NF4RunsOut&) { no_kernel("quantize_nf4"); },
      .nf4_decode = [](const NF4Runs&, DType, void*) { no_kernel("dequantize"); },
      .nf4_linear = [](DType, const void*, int64_t, int64_t, const NF4Runs&, DType, int64_t,
                       const void*, void*) { no_kernel("nf4_linear"); },
      .nf4_linear_grad = [](DType, const void*, int64_t, int64_t, const NF4Runs&, DType, int64_t,
                            void*) { no_kernel("nf4_linear backward"); },
  };
  return t;
}

}  // namespace quanta::quant::quant_cuda
