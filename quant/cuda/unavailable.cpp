// quant_cuda::table() in libquanta: the CUDA module's quantizer table
// (quanta_quant_cuda_table_v1, found by name as dist finds its NCCL backend),
// or, in a build without CUDA or where the module cannot be loaded, a table
// whose entries throw naming the op and the reason. Links no CUDA library.
#include <stdexcept>
#include <string>

#include "engine/cuda/module_table.h"
#include "quant/kernels/table.h"

namespace quanta::quant::quant_cuda {
namespace {

const cuda::ModuleTable<QuantKernelTable>& chosen() {
  static const cuda::ModuleTable<QuantKernelTable> c("quant_kernels", "quanta_quant_cuda_table_v1",
                                                     unavailable_table());
  return c;
}

[[noreturn]] void unavailable(const char* op) {
  cuda::no_cuda_kernel(op, chosen().reason, "quantizer");
}

}  // namespace

// One line an entry: each lambda takes the entry's arguments as they come
// (auto...), naming the ones that choose the op.
const QuantKernelTable& unavailable_table() {
  static const QuantKernelTable t{
      .device_name = "cuda",
      .nearest_codes = [](auto...) { unavailable("nearest_codes"); },
      .squared_error = [](auto...) { unavailable("commitment_loss"); },
      .squared_error_mean = [](auto...) { unavailable("commitment_loss"); },
      .squared_error_coefficient = [](auto...) { unavailable("commitment_loss backward"); },
      .squared_error_grad = [](auto...) { unavailable("commitment_loss backward"); },
      .route_grad =
          [](bool rotation, auto...) {
            unavailable(rotation ? "rotate_to backward"
                                 : "straight_through_with_commitment backward");
          },
      .dead_code_picks = [](auto...) { unavailable("Codebook"); },
      .replace_codes = [](auto...) { unavailable("Codebook"); },
      .code_statistics = [](auto...) { unavailable("code_statistics"); },
      .ema_lerp = [](auto...) { unavailable("Codebook EMA"); },
      .ema_embed = [](auto...) { unavailable("Codebook EMA"); },
      .bit_probabilities = [](auto...) { unavailable("lfq_bit_probabilities"); },
      .bit_probabilities_grad = [](auto...) { unavailable("lfq_bit_probabilities backward"); },
      .bit_product = [](auto...) { unavailable("lfq_bit_product"); },
      .bit_product_grad = [](auto...) { unavailable("lfq_bit_product backward"); },
      .clamped_entropy = [](auto...) { unavailable("lfq_clamped_entropy"); },
      .nf4_absmax = [](auto...) { unavailable("quantize_nf4"); },
      .nf4_encode = [](auto...) { unavailable("quantize_nf4"); },
      .nf4_decode = [](auto...) { unavailable("dequantize"); },
      .nf4_linear = [](auto...) { unavailable("nf4_linear"); },
      .nf4_linear_grad = [](auto...) { unavailable("nf4_linear backward"); },
  };
  return t;
}

const QuantKernelTable& table() { return *chosen().table; }

}  // namespace quanta::quant::quant_cuda
