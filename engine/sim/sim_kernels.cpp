// sim's kernel table: the CPU's kernels, each queued on the sim device's
// stream (engine/sim/queued.h), so results are the CPU's bits and arrive as
// a GPU's do, later.
#include <type_traits>

#include "engine/sim/queued.h"

namespace quanta::sim {
namespace {

template <class F>
struct ReturnOf;
template <class R, class... A>
struct ReturnOf<R (*)(A...)> {
  using type = R;
};

// Entry `Member` of sim's table: the CPU's kernel queued; an entry that
// answers a question (gemm_maps: which layouts gemm takes) is answered on
// the host, as CUDA's is.
template <auto Member>
auto sim_entry() {
  using Fn = std::remove_cvref_t<decltype(cpu::cpu_kernels().*Member)>;
  if constexpr (std::is_void_v<typename ReturnOf<Fn>::type>)
    return Queued<&cpu::cpu_kernels, Member>::call;
  else
    return cpu::cpu_kernels().*Member;
}

}  // namespace

const KernelTable& sim_kernels() {
#define QUANTA_SIM_KERNEL(entry) .entry = sim_entry<&KernelTable::entry>(),
  static const KernelTable table{.device_name = "sim",
                                 .gemm_bf16 = cpu::cpu_kernels().gemm_bf16,
                                 .gemm_f16 = cpu::cpu_kernels().gemm_f16,
                                 .half_elementwise = cpu::cpu_kernels().half_elementwise,
                                 .half_reductions = cpu::cpu_kernels().half_reductions,
                                 .dropout_keeps_bits = cpu::cpu_kernels().dropout_keeps_bits,
                                 QUANTA_KERNEL_ENTRIES(QUANTA_SIM_KERNEL)};
#undef QUANTA_SIM_KERNEL
  return table;
}

}  // namespace quanta::sim
