// The CUDA kernel table when there is no CUDA backend (built without nvcc,
// or libquanta_cuda could not be loaded): every entry throws naming its op
// and the reason, e.g. "[exp] quanta was built without CUDA (...)".
#include <stdexcept>
#include <string>

#include "engine/cuda/module.h"
#include "engine/kernels/table.h"

namespace quanta {
namespace cuda {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw std::runtime_error(std::string("[") + what + "] " + unavailable_reason());
}
}  // namespace

// Every entry names its op: "[exp] quanta was built without CUDA ...".
const KernelTable& unavailable_kernels() {
  static const KernelTable table{
      .device_name = "cuda",
      .fill = [](const Shape&, const Operand&, double) { no_cuda("fill_"); },
      .copy = [](const Shape&, const Operand&, const Operand&) { no_cuda("copy_"); },
      .unary = [](UnaryOp op, const ScalarArgs&, const Shape&, const Operand&,
                  const Operand&) { no_cuda(op_name(op)); },
      .binary = [](BinaryOp op, const Shape&, const Operand&, const Operand&,
                   const Operand&) { no_cuda(op_name(op)); },
      .update = [](UpdateOp op, const ScalarArgs&, const Shape&, const Operand&, const Operand&,
                   const Operand&) { no_cuda(op_name(op)); },
      .where = [](const Shape&, const Operand&, const Operand&, const Operand&,
                  const Operand&) { no_cuda("where"); },
      .reduce_rows = [](RowReduce op, DType, const void*, int64_t, int64_t,
                        void*) { no_cuda(op_name(op)); },
      .gemm_maps = [](int64_t, int64_t, int64_t, int64_t) -> bool { no_cuda("gemm"); },
      .gemm = [](const GemmArgs&) { no_cuda("gemm"); },
      .gemm_16bit = false,
      .stat_rows = [](RowStat op, double, DType, const void*, int64_t, int64_t,
                      void*) { no_cuda(op_name(op)); },
      .index_rows = [](RowReduce op, DType, const void*, int64_t, int64_t, int64_t*,
                       void*) { no_cuda(op == RowReduce::max ? "argmax" : "argmin"); },
      .cumsum = [](DType, const void*, int64_t, int64_t, int64_t, bool,
                   void*) { no_cuda("cumsum"); },
      .softmax = [](bool log, DType, const void*, int64_t, int64_t, int64_t,
                    void*) { no_cuda(log ? "log_softmax" : "softmax"); },
      .index_select = [](DType, const void*, int64_t, int64_t, int64_t, const int64_t*, int64_t,
                         void*) { no_cuda("index_select"); },
      .index_lines =
          [](IndexMode mode, const Shape&, int64_t, const Operand&, const Operand&, const Operand&,
             double) {
            no_cuda(mode == IndexMode::gather        ? "gather"
                    : mode == IndexMode::scatter_add ? "scatter_add"
                                                     : "scatter");
          },
      .index_add = [](DType, void*, int64_t, int64_t, int64_t, const int64_t*, int64_t, const void*,
                      double) { no_cuda("index_add"); },
      .checked_indices = [](const int64_t*, int64_t, int64_t, int64_t*, DeviceErrorFlag*,
                            int32_t) { no_cuda("index bounds check"); },
      .conv =
          [](ConvKind kind, DType, const ConvGeom&, const void*, const void*, const void*, void*) {
            no_cuda(kind == ConvKind::forward      ? "conv2d"
                    : kind == ConvKind::input_grad ? "conv_transpose2d"
                                                   : "conv2d_weight_grad");
          },
      .avg_pool = [](bool adjoint, DType, const PoolWindow&, const void*,
                     void*) { no_cuda(adjoint ? "avg_pool2d_backward" : "avg_pool2d"); },
      .max_pool = [](DType, const PoolWindow&, const void*, void*,
                     int64_t*) { no_cuda("max_pool2d"); },
      .max_pool_route =
          [](bool scatter, DType, const PoolWindow&, const int64_t*, const void*, void*) {
            no_cuda(scatter ? "max_pool2d_backward" : "max_pool2d_gather");
          },
      .upsample_nearest2x = [](DType, int64_t, int64_t, const void*,
                               void*) { no_cuda("interpolate_nearest2x"); },
      .sq_dist_finish = [](DType, const void*, const void*, int64_t, int64_t, int64_t,
                           void*) { no_cuda("sq_dist"); },
      .random_fill = [](const RandomFill&, int64_t, void*) { no_cuda("random fill"); },
      .sgd_step = [](const SgdStep&, DType, int64_t, void*, const void*,
                     void*) { no_cuda("SGD step"); },
      .adam_step = [](const AdamStep&, DType, int64_t, void*, const void*, void*, void*,
                      void*) { no_cuda("Adam step"); },
  };
  return table;
}

}  // namespace cuda
}  // namespace quanta
