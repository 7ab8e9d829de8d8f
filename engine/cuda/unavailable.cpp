// The CUDA kernel table when there is no CUDA backend (built without nvcc,
// or libquanta_cuda could not be loaded): every entry throws naming its op
// and the reason, e.g. "[exp] quanta was built without CUDA (...)". One line
// an entry: each lambda takes the entry's arguments as they come (auto...),
// naming the ones that choose the op.
#include <stdexcept>
#include <string>

#include "engine/cuda/module.h"
#include "engine/kernels/table.h"

namespace quanta::cuda {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw std::runtime_error(std::string("[") + what + "] " + unavailable_reason());
}
}  // namespace

const KernelTable& unavailable_kernels() {
  static const KernelTable table{
      .device_name = "cuda",
      .gemm_bf16 = false,
      .gemm_f16 = false,
      .half_elementwise = false,
      .half_reductions = false,
      .dropout_keeps_bits = false,
      .fill = [](auto...) { no_cuda("fill_"); },
      .copy = [](auto...) { no_cuda("copy_"); },
      .unary = [](UnaryOp op, auto...) { no_cuda(op_name(op)); },
      .binary = [](BinaryOp op, auto...) { no_cuda(op_name(op)); },
      .update = [](UpdateOp op, auto...) { no_cuda(op_name(op)); },
      .where = [](auto...) { no_cuda("where"); },
      .add_n = [](auto...) { no_cuda("add_n"); },
      .reduce_rows = [](RowReduce op, auto...) { no_cuda(op_name(op)); },
      .reduce_grid = [](RowReduce op, auto...) { no_cuda(op_name(op)); },
      .gemm_maps = [](auto...) -> bool { no_cuda("gemm"); },
      .gemm = [](auto...) { no_cuda("gemm"); },
      .stat_rows = [](RowStat op, auto...) { no_cuda(op_name(op)); },
      .index_rows = [](RowReduce op,
                       auto...) { no_cuda(op == RowReduce::max ? "argmax" : "argmin"); },
      .cumsum = [](auto...) { no_cuda("cumsum"); },
      .softmax = [](bool log, auto...) { no_cuda(log ? "log_softmax" : "softmax"); },
      .index_select = [](auto...) { no_cuda("index_select"); },
      .index_lines =
          [](IndexMode mode, auto...) {
            no_cuda(mode == IndexMode::gather        ? "gather"
                    : mode == IndexMode::scatter_add ? "scatter_add"
                                                     : "scatter");
          },
      .index_add = [](auto...) { no_cuda("index_add"); },
      .checked_indices = [](auto...) { no_cuda("index bounds check"); },
      .conv =
          [](ConvKind kind, auto...) {
            no_cuda(kind == ConvKind::forward      ? "conv2d"
                    : kind == ConvKind::input_grad ? "conv_transpose2d"
                                                   : "conv2d_weight_grad");
          },
      .avg_pool = [](bool adjoint,
                     auto...) { no_cuda(adjoint ? "avg_pool2d_backward" : "avg_pool2d"); },
      .max_pool = [](auto...) { no_cuda("max_pool2d"); },
      .max_pool_route =
          [](bool scatter, auto...) {
            no_cuda(scatter ? "max_pool2d_backward" : "max_pool2d_gather");
          },
      .upsample_nearest2x = [](auto...) { no_cuda("interpolate_nearest2x"); },
      .sq_dist_finish = [](auto...) { no_cuda("sq_dist"); },
      .random_fill = [](auto...) { no_cuda("random fill"); },
      .dropout_product = [](auto...) { no_cuda("dropout_linear"); },
      .sort_pairs = [](auto...) { no_cuda("randperm"); },
      .sgd_step = [](auto...) { no_cuda("SGD step"); },
      .adam_step = [](auto...) { no_cuda("Adam step"); },
      .scale_n = [](auto...) { no_cuda("clip_grad_norm_"); },
      .norm_n = [](auto...) { no_cuda("clip_grad_norm_"); },
      .clip_factor = [](auto...) { no_cuda("clip_grad_norm_"); },
      .copy_blocks = [](auto...) { no_cuda("cat"); },
      .group_norm = [](auto...) { no_cuda("group_norm"); },
      .group_norm_grad = [](auto...) { no_cuda("group_norm backward"); },
  };
  return table;
}

}  // namespace quanta::cuda
