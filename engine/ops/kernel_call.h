#pragma once
// How an op calls its device's kernel table: the dtype a kernel computes in,
// broadcasting, operands, and the calls of the elementwise families. Op
// files hold validation and the backward formulas.
#include <algorithm>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/cpu/convert.h"
#include "engine/cpu/loop.h"
#include "engine/dispatch.h"
#include "engine/kernels/table.h"
#include "engine/ops/view.h"

namespace quanta::detail {

/** Dtype a floating kernel computes in (16-bit floats use f32; a device whose
 * kernels take 16-bit data directly, gemm_bf16 / gemm_f16, is asked by its op). */
inline DType compute_dtype(DType t) {
  return (t == DType::bf16 || t == DType::f16) ? DType::f32 : t;
}

/** The dtype an elementwise kernel of `k` (unary, binary, update) runs a
 * result of dtype `want` in: a 16-bit float itself where the device takes
 * 16-bit operands (half_elementwise) and every input already has that dtype,
 * else compute_dtype(want). Either way the result's bits are the same. */
inline DType elementwise_dtype(const KernelTable& k, DType want,
                               std::initializer_list<const Tensor*> inputs) {
  const DType ct = compute_dtype(want);
  if (ct == want || !k.half_elementwise) return ct;
  for (const Tensor* t : inputs)
    if (t->dtype() != want) return ct;
  return want;
}

/** `x` as dtype `t`, with no graph (kernels see plain values). */
inline Tensor as_plain(const Tensor& x, DType t) {
  NoGradGuard no_grad;
  return to_dtype(x.detach(), t);
}

/** y = op(x) in floating point (16-bit floats compute in f32, integers in
 * f32), on x's device, through its kernel table. */
inline Tensor unary_float(UnaryOp op, const Tensor& x, ScalarArgs args = {}) {
  const KernelTable& k = kernels_for(op_name(op), {&x});
  check_arithmetic(op_name(op), {x.dtype()});
  const DType out_dt = to_floating(x.dtype());
  const DType ct = elementwise_dtype(k, out_dt, {&x});
  Tensor in = as_plain(x, ct);
  Tensor out = make_tensor(x.shape(), ct, x.device());
  k.unary(op, args, x.shape(), operand_of(out), operand_of(in));
  return ct == out_dt ? out : as_plain(out, out_dt);
}

/** out = op(a, b) with broadcasting, computed in elementwise_dtype(want):
 * inputs are converted to it, and the result has that dtype (arithmetic ops)
 * or bool (predicates). `want` is the result's dtype, or the dtype a
 * predicate compares in. */
inline Tensor binary_kernel(BinaryOp op, const Tensor& a, const Tensor& b, DType want) {
  const char* name = op_name(op);
  const KernelTable& k = kernels_for(name, {&a, &b});
  const DType compute = elementwise_dtype(k, want, {&a, &b});
  const Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  Tensor ea = as_plain(a, compute), eb = as_plain(b, compute);
  if (ea.shape() != shape) ea = expand(ea, shape);
  if (eb.shape() != shape) eb = expand(eb, shape);
  Tensor out = make_tensor(shape, is_predicate(op) ? DType::boolean : compute, a.device());
  k.binary(op, shape, operand_of(out), operand_of(ea), operand_of(eb));
  return out;
}

}  // namespace quanta::detail
