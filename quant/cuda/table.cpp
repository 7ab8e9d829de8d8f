// quant_cuda::table() in libquanta: the CUDA module's quantizer table
// (quanta_quant_cuda_table_v1, found by name as dist finds its NCCL backend),
// or, in a build without CUDA or where the module cannot be loaded, a table
// whose entries throw naming the op and the reason. Links no CUDA library.
#include "quant/kernels/table.h"

#include <stdexcept>
#include <string>

#include "engine/cuda/module.h"

namespace quanta::quant::quant_cuda {
namespace {

struct Chosen {
  const QuantKernelTable* table = nullptr;
  std::string reason;  // why `table` is the unavailable one
};

const Chosen& chosen() {
  static const Chosen c = []() -> Chosen {
    if (!cuda::module()) return {&unavailable_table(), cuda::unavailable_reason()};
    try {
      using Entry = const QuantKernelTable* (*)();
      auto entry = reinterpret_cast<Entry>(
          cuda::module_symbol("quant_kernels", "quanta_quant_cuda_table_v1"));
      return {entry(), ""};
    } catch (const std::exception& e) {
      return {&unavailable_table(), e.what()};
    }
  }();
  return c;
}

[[noreturn]] void unavailable(const char* op) {
  const std::string& why = chosen().reason;
  throw std::runtime_error(std::string("[") + op + "] has no CUDA kernel here: " +
                           (why.empty() ? "the CUDA module's quantizer table is not in use" : why) +
                           "; move the tensors to cpu");
}

}  // namespace

const QuantKernelTable& unavailable_table() {
  static const QuantKernelTable t{
      .device_name = "cuda",
      .nearest_codes = [](DType, const void*, const void*, int64_t, int64_t, int64_t, bool,
                          int64_t*) { unavailable("nearest_codes"); },
      .squared_error = [](DType, const void*, const void*, const uint8_t*, int64_t, int64_t,
                          double*) { unavailable("commitment_loss"); },
      .squared_error_grad = [](DType, const void*, const void*, const uint8_t*, int64_t, int64_t,
                               const double*, void*) { unavailable("commitment_loss backward"); },
      .route_grad =
          [](bool rotation, DType, const void*, const void*, const void*, const uint8_t*,
             const double*, int64_t, int64_t, void*) {
            unavailable(rotation ? "rotate_to backward"
                                 : "straight_through_with_commitment backward");
          },
      .put_rows = [](DType, void*, int64_t, const int64_t*, int64_t, const void*,
                     double) { unavailable("Codebook"); },
      .code_statistics = [](DType, const int64_t*, const void*, int64_t, int64_t, int64_t, void*,
                            void*) { unavailable("code_statistics"); },
      .bit_product = [](DType, const void*, int64_t, int64_t,
                        void*) { unavailable("lfq_bit_product"); },
      .bit_product_grad = [](DType, const void*, const void*, int64_t, int64_t,
                             void*) { unavailable("lfq_bit_product backward"); },
      .clamped_entropy = [](const double*, int64_t, int64_t, double*,
                            double*) { unavailable("lfq_clamped_entropy"); },
      .nf4_absmax = [](const float*, int64_t, int64_t, float*) { unavailable("quantize_nf4"); },
      .nf4_encode = [](const float*, int64_t, int64_t, const float*, const float*,
                       const NF4RunsOut&) { unavailable("quantize_nf4"); },
      .nf4_decode = [](const NF4Runs&, DType, void*) { unavailable("dequantize"); },
      .nf4_linear = [](DType, const void*, int64_t, int64_t, const NF4Runs&, DType, int64_t,
                       const void*, void*) { unavailable("nf4_linear"); },
      .nf4_linear_grad = [](DType, const void*, int64_t, int64_t, const NF4Runs&, DType, int64_t,
                            void*) { unavailable("nf4_linear backward"); },
  };
  return t;
}

const QuantKernelTable& table() { return *chosen().table; }

}  // namespace quanta::quant::quant_cuda
