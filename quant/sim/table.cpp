// sim's quantizer table: the CPU's entries, each queued on the current sim
// device's stream, as the engine's sim table queues its kernels.
#include "quant/kernels/table.h"

#include "engine/sim/queued.h"

namespace quanta::quant::quant_sim {

const QuantKernelTable& table() {
  using quant_cpu::table;
  using sim::Queued;
  using T = QuantKernelTable;
  static const QuantKernelTable t{
      .device_name = "sim",
      .nearest_codes = Queued<&table, &T::nearest_codes>::call,
      .squared_error = Queued<&table, &T::squared_error>::call,
      .squared_error_grad = Queued<&table, &T::squared_error_grad>::call,
      .route_grad = Queued<&table, &T::route_grad>::call,
      .put_rows = Queued<&table, &T::put_rows>::call,
      .code_statistics = Queued<&table, &T::code_statistics>::call,
      .bit_product = Queued<&table, &T::bit_product>::call,
      .bit_product_grad = Queued<&table, &T::bit_product_grad>::call,
      .clamped_entropy = Queued<&table, &T::clamped_entropy>::call,
      .nf4_absmax = Queued<&table, &T::nf4_absmax>::call,
      .nf4_encode = Queued<&table, &T::nf4_encode>::call,
      .nf4_decode = Queued<&table, &T::nf4_decode>::call,
      .nf4_linear = Queued<&table, &T::nf4_linear>::call,
      .nf4_linear_grad = Queued<&table, &T::nf4_linear_grad>::call,
  };
  return t;
}

}  // namespace quanta::quant::quant_sim
