#pragma once
#include <algorithm>
// Shared machinery for elementwise ops: dtype selection, broadcasting and the
// CPU map. Op files hold only the math and the backward formulas.
#include <stdexcept>
#include <string>

#include <Eigen/Core>

#include "engine/autograd/grad_mode.h"
#include "engine/cpu/convert.h"
#include "engine/cpu/loop.h"
#include "engine/device_check.h"
#include "engine/dispatch.h"
#include "engine/ops/view.h"

namespace quanta::detail {

/** Dtype a floating kernel computes in on the CPU (16-bit floats use f32). */
inline DType cpu_compute_dtype(DType t) {
  return (t == DType::bf16 || t == DType::f16) ? DType::f32 : t;
}

/** `x` as dtype `t`, with no graph (kernels see plain values). */
inline Tensor as_plain(const Tensor& x, DType t) {
  NoGradGuard no_grad;
  return to_dtype(x.detach(), t);
}

/** y = f(x) in floating point. `f` works on a scalar; `vec`, when given,
 * works on an Eigen array and is used for contiguous inputs; `fixup`, when
 * given, is called as fixup(src, dst, n) on each chunk after `vec` (a scalar
 * pass for the rare inputs a vector formula gets wrong: Eigen's select does
 * not vectorise, a plain loop after the vector pass costs next to nothing). */
template <class F, class Vec = std::nullptr_t, class Fixup = std::nullptr_t>
Tensor unary_float(const char* op, const Tensor& x, F f, Vec vec = nullptr,
                   Fixup fixup = nullptr) {
  check_cpu(op, {&x});
  check_arithmetic(op, {x.dtype()});
  const DType out_dt = to_floating(x.dtype());
  const DType ct = cpu_compute_dtype(out_dt);
  Tensor in = as_plain(x, ct);
  Tensor out = make_tensor(x.shape(), ct, Device::cpu());
  dispatch_float(ct, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (!std::is_same_v<Vec, std::nullptr_t>) {
      if (in.is_contiguous()) {
        const T* src = in.data<T>();
        T* dst = out.data<T>();
        cpu::parallel_for(0, in.numel(), cpu::kGrainElements, [&](int64_t lo, int64_t hi) {
          using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
          // In L1/L2-sized pieces, so the fixup pass reads what the vector
          // pass just touched instead of streaming the chunk from memory again.
          constexpr int64_t kPiece = 8192;
          for (int64_t a = lo; a < hi; a += kPiece) {
            const int64_t b = std::min(hi, a + kPiece);
            Eigen::Map<Arr>(dst + a, b - a) = vec(Eigen::Map<const Arr>(src + a, b - a));
            if constexpr (!std::is_same_v<Fixup, std::nullptr_t>) fixup(src + a, dst + a, b - a);
          }
        });
        return;
      }
    }
    cpu::map<T, T>(out, f, in);
  });
  return ct == out_dt ? out : as_plain(out, out_dt);
}

/** out = f(a, b) with broadcasting; inputs are converted to `compute`, the
 * result has dtype `out_dt`: the compute dtype (arithmetic) or bool
 * (comparisons, logical ops). Only those two pairings are instantiated: a
 * kernel per (compute, out) pair of every dtype would multiply the compile
 * time of each op by the number of dtypes for nothing. */
template <class F>
Tensor binary_kernel(const char* op, const Tensor& a, const Tensor& b, DType compute,
                     DType out_dt, F f) {
  check_cpu(op, {&a, &b});
  if (out_dt != compute && out_dt != DType::boolean)
    throw std::logic_error(std::string("[") + op + "] binary kernel: output dtype " +
                           dtype_name(out_dt) + " is neither the compute dtype nor bool");
  const Shape shape = broadcast_shapes(a.shape(), b.shape(), op);
  Tensor ea = as_plain(a, compute), eb = as_plain(b, compute);
  if (ea.shape() != shape) ea = expand(ea, shape);
  if (eb.shape() != shape) eb = expand(eb, shape);
  Tensor out = make_tensor(shape, out_dt, Device::cpu());
  dispatch_numeric(compute, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (out_dt == compute) {
      cpu::map<T, T, T>(out, [&](T x, T y) { return static_cast<T>(f(x, y)); }, ea, eb);
    } else {
      cpu::map<bool, T, T>(out, [&](T x, T y) { return static_cast<bool>(f(x, y)); }, ea, eb);
    }
  });
  return out;
}

}  // namespace quanta::detail
