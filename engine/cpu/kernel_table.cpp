// The CPU kernel table: every family's CPU entry in one place.
#include "engine/cpu/gemm.h"
#include "engine/cpu/kernels.h"

namespace quanta::cpu {

const KernelTable& cpu_kernels() {
  static const KernelTable table{
      .device_name = "cpu",
      .fill = fill,
      .copy = copy,
      .unary = unary,
      .binary = binary,
      .update = update,
      .where = where,
      .reduce_rows = reduce_rows,
      .gemm_maps = gemm_maps,
      .gemm = gemm_entry,
      .gemm_16bit = false,
      .stat_rows = stat_rows,
      .index_rows = index_rows,
      .cumsum = cumsum,
      .softmax = softmax,
      .index_select = index_select,
      .index_lines = index_lines,
      .index_add = index_add,
      .checked_indices = checked_indices,
      .conv = conv,
      .avg_pool = avg_pool,
      .max_pool = max_pool,
      .max_pool_route = max_pool_route,
      .upsample_nearest2x = upsample_nearest2x,
      .sq_dist_finish = sq_dist_finish,
      .random_fill = random_fill,
      .sgd_step = sgd_step,
      .adam_step = adam_step,
  };
  return table;
}

}  // namespace quanta::cpu
