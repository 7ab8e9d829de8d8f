// sim's kernel table: the CPU's kernels, each queued on the sim device's
// stream (engine/sim/queued.h), so results are the CPU's bits and arrive as
// a GPU's do, later.
#include "engine/sim/queued.h"

namespace quanta::sim {

const KernelTable& sim_kernels() {
  using cpu::cpu_kernels;
  using K = KernelTable;
  static const KernelTable table{
      .device_name = "sim",
      .fill = Queued<&cpu_kernels, &K::fill>::call,
      .copy = Queued<&cpu_kernels, &K::copy>::call,
      .unary = Queued<&cpu_kernels, &K::unary>::call,
      .binary = Queued<&cpu_kernels, &K::binary>::call,
      .update = Queued<&cpu_kernels, &K::update>::call,
      .where = Queued<&cpu_kernels, &K::where>::call,
      .reduce_rows = Queued<&cpu_kernels, &K::reduce_rows>::call,
      // A question about layouts, answered on the host as CUDA's is.
      .gemm_maps = cpu_kernels().gemm_maps,
      .gemm = Queued<&cpu_kernels, &K::gemm>::call,
      .gemm_16bit = cpu_kernels().gemm_16bit,
      .stat_rows = Queued<&cpu_kernels, &K::stat_rows>::call,
      .index_rows = Queued<&cpu_kernels, &K::index_rows>::call,
      .cumsum = Queued<&cpu_kernels, &K::cumsum>::call,
      .softmax = Queued<&cpu_kernels, &K::softmax>::call,
      .index_select = Queued<&cpu_kernels, &K::index_select>::call,
      .index_lines = Queued<&cpu_kernels, &K::index_lines>::call,
      .index_add = Queued<&cpu_kernels, &K::index_add>::call,
      .checked_indices = Queued<&cpu_kernels, &K::checked_indices>::call,
      .conv = Queued<&cpu_kernels, &K::conv>::call,
      .avg_pool = Queued<&cpu_kernels, &K::avg_pool>::call,
      .max_pool = Queued<&cpu_kernels, &K::max_pool>::call,
      .max_pool_route = Queued<&cpu_kernels, &K::max_pool_route>::call,
      .upsample_nearest2x = Queued<&cpu_kernels, &K::upsample_nearest2x>::call,
      .sq_dist_finish = Queued<&cpu_kernels, &K::sq_dist_finish>::call,
      .random_fill = Queued<&cpu_kernels, &K::random_fill>::call,
      .sgd_step = Queued<&cpu_kernels, &K::sgd_step>::call,
      .adam_step = Queued<&cpu_kernels, &K::adam_step>::call,
  };
  return table;
}

}  // namespace quanta::sim
