#pragma once
// Element-wise reductions used by the collectives: the function Gloo calls
// between two buffers, a local reduction of gathered blocks, and avg's
// division. Internal to dist.
#include <cstddef>
#include <functional>

#include "dist/process_group.h"
#include "engine/dtype.h"

namespace quanta::dist::detail {

/** c[i] = a[i] (op) b[i] for n elements of `dtype` (avg reduces as sum). */
using ReduceFn = std::function<void(void* c, const void* a, const void* b, std::size_t n)>;

/** Throws std::invalid_argument naming `op_name` when `dtype` cannot be
 * reduced with `op` (nf4 and bool refuse arithmetic; avg needs floating). */
void check_reducible(const char* op_name, DType dtype, ReduceOp op);
/** The reduction of `op` on `dtype` (checked with check_reducible first). */
ReduceFn reduce_fn(DType dtype, ReduceOp op);
/** data[i] /= divisor for n floating elements of `dtype` (avg's last step). */
void divide(void* data, DType dtype, std::size_t n, double divisor);

}  // namespace quanta::dist::detail
