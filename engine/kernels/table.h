#pragma once
// The device seam: one table of kernels per device, one entry per kernel
// family (in the manner of ggml's backend vtable and candle's BackendStorage).
// Ops keep validation, dtype promotion, shape rules and the gradient rule,
// and call `kernels(device).<family>(...)` for the work. Entries take raw
// pointers, one shared shape, per-operand strides and dtypes; they never see
// a Tensor, so engine/cpu/ and engine/cuda/ know nothing of ops or autograd.
//
// Where a new op goes: its math as a functor in functors.h (and a row in the
// op list there) when it is elementwise, else a new family here with an entry
// in every device's table. Where a new device goes: a file that fills a
// KernelTable, and one case in kernels() (table.cpp).
#include <cstdint>
#include <initializer_list>

#include "engine/device.h"
#include "engine/dtype.h"
#include "engine/kernels/functors.h"
#include "engine/shape.h"

namespace quanta {

class Tensor;

/** One strided operand of an elementwise kernel: element i (a multi-index
 * over the kernel's shape) lives at data + sum(i[d] * strides[d]) elements.
 * A broadcast input has stride 0 along the broadcast dims. */
struct Operand {
  void* data = nullptr;
  DType dtype = DType::f32;
  const int64_t* strides = nullptr;  // one per dim of the kernel's shape
};

/** A strided matrix: element (i, j) at data + i * rs + j * cs elements. */
struct MatOperand {
  const void* data = nullptr;
  int64_t rs = 0;
  int64_t cs = 0;
};

/** `batch` products C_i = A_i B_i (or C_i += A_i B_i when `accumulate`):
 * A_i [m, k] starts at a_off[i] elements past a.data (all 0 when a_off is
 * null), likewise B_i [k, n]; C_i is row-major with row stride ldc and
 * starts at i * m * ldc. Operands satisfy the table's gemm_maps. */
struct GemmArgs {
  DType dtype = DType::f32;
  int64_t batch = 1, m = 0, n = 0, k = 0;
  MatOperand a, b;
  const int64_t* a_off = nullptr;
  const int64_t* b_off = nullptr;
  void* c = nullptr;
  int64_t ldc = 0;
  bool accumulate = false;
};

/** What a row reduction computes per row. */
enum class RowReduce : uint8_t { sum };

/** The kernels of one device. Every entry handles zero-size shapes. */
struct KernelTable {
  const char* device_name;

  /** dst[i] = value converted to dst's dtype (any plain dtype). */
  void (*fill)(const Shape& shape, const Operand& dst, double value);
  /** dst[i] = src[i] converted (cast and strided copy; any plain dtypes). */
  void (*copy)(const Shape& shape, const Operand& dst, const Operand& src);
  /** out[i] = op(in[i]); out and in share a floating dtype (f32 or f64). */
  void (*unary)(UnaryOp op, const ScalarArgs& args, const Shape& shape, const Operand& out,
                const Operand& in);
  /** out[i] = op(a[i], b[i]); a and b share a numeric dtype, out has it too
   * (arithmetic) or is bool (predicates). */
  void (*binary)(BinaryOp op, const Shape& shape, const Operand& out, const Operand& a,
                 const Operand& b);
  /** dst[i] = op(dst[i], a[i], b[i]), all of dst's numeric dtype. */
  void (*update)(UpdateOp op, const ScalarArgs& args, const Shape& shape, const Operand& dst,
                 const Operand& a, const Operand& b);
  /** out[i] = cond[i] ? a[i] : b[i]; cond is bool, the rest share a dtype. */
  void (*where)(const Shape& shape, const Operand& out, const Operand& cond, const Operand& a,
                const Operand& b);
  /** out[r] = reduce(rows[r, 0..inner)) for r < outer; rows contiguous, out
   * contiguous. Floating input reduces in its own dtype, integral into i64. */
  void (*reduce_rows)(RowReduce op, DType in_dtype, const void* rows, int64_t outer,
                      int64_t inner, void* out);
  /** True when a rows x cols matrix with strides (rs, cs) is a GEMM operand
   * this device takes without a copy. */
  bool (*gemm_maps)(int64_t rows, int64_t cols, int64_t rs, int64_t cs);
  /** Matrix products in f32 or f64 (see GemmArgs). */
  void (*gemm)(const GemmArgs& args);
};

/** The kernel table of `device`; for CUDA in a build without CUDA, a table
 * whose every entry throws "[op] quanta was built without CUDA". */
const KernelTable& kernels(Device device);

/** The table of the device that all of `ts`' defined tensors live on; throws
 * naming `op` and both devices when they differ. */
const KernelTable& kernels_for(const char* op, std::initializer_list<const Tensor*> ts);

/** The operand view of a tensor: its data (on its device), dtype, strides. */
Operand operand_of(const Tensor& t);

/** Name of an elementwise op, for errors ("exp", "add", "addcmul"). */
const char* op_name(UnaryOp op);
const char* op_name(BinaryOp op);
const char* op_name(UpdateOp op);

namespace cpu {
/** The CPU table (engine/cpu/). */
const KernelTable& cpu_kernels();
}  // namespace cpu
namespace cuda {
/** The CUDA table (engine/cuda/kernels.cu), or the throwing one without CUDA. */
const KernelTable& cuda_kernels();
}  // namespace cuda

}  // namespace quanta
