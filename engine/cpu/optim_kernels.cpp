// Fused optimizer steps on the CPU: one parallel pass per parameter through
// the shared per-element updates (engine/kernels/optim_functors.h).
#include <cstdlib>
#include <memory>
#include <new>

#include "engine/cpu/convert.h"
#include "engine/cpu/kernels.h"
#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"
#include "engine/kernels/optim_functors.h"

namespace quanta::cpu {

void sgd_step(const SgdStep& s, DType dtype, int64_t n, void* param, const void* grad,
              void* momentum_buffer) {
  dispatch_float(dtype, "SGD step", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const fn::SgdUpdate<T> f(fn::read_live(s));
    T* p = static_cast<T*>(param);
    const T* g = static_cast<const T*>(grad);
    T* buf = static_cast<T*>(momentum_buffer);
    parallel_for(0, n, kGrainElements, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) f(p[i], g[i], buf ? buf + i : nullptr);
    });
  });
}

namespace {

// One parameter's Adam step.
void adam_one(const AdamStep& s, DType dtype, int64_t n, void* param, const void* grad,
              void* exp_avg, void* exp_avg_sq, void* max_exp_avg_sq) {
  dispatch_float(dtype, "Adam step", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const fn::AdamUpdate<T> f(s);
    T* p = static_cast<T*>(param);
    const T* g = static_cast<const T*>(grad);
    T* m = static_cast<T*>(exp_avg);
    T* v = static_cast<T*>(exp_avg_sq);
    T* vmax = static_cast<T*>(max_exp_avg_sq);
    if (n == 0) return;
    // Three passes, so the square root is the chain's own sqrt kernel (its
    // Eigen vector form is not correctly rounded; see optim_functors.h).
    // 64-byte aligned like a tensor's storage: Eigen's vector loop then
    // splits the buffer exactly as it splits the chain's sqrt output.
    const std::size_t bytes = (sizeof(T) * static_cast<std::size_t>(n) + 63) / 64 * 64;
    const std::unique_ptr<T, decltype(&std::free)> buf(
        static_cast<T*>(std::aligned_alloc(64, bytes)), &std::free);
    if (!buf) throw std::bad_alloc();
    T* root = buf.get();
    parallel_for(0, n, kGrainElements, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i)
        root[i] = f.moments(p[i], g[i], m[i], v[i], vmax ? vmax + i : nullptr);
    });
    const int64_t unit[1] = {1};
    const Operand r{root, dtype, unit};
    unary(UnaryOp::sqrt, {}, Shape{n}, r, r);
    parallel_for(0, n, kGrainElements, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) f.apply(p[i], m[i], root[i]);
    });
  });
}

}  // namespace

void adam_step(DType dtype, const AdamTensorList& tensors) {
  for (int64_t i = 0; i < tensors.count; ++i) {
    const AdamTensor& t = tensors.data[i];
    adam_one(fn::read_live(t.s), dtype, t.n, t.param, t.grad, t.exp_avg, t.exp_avg_sq,
             t.max_exp_avg_sq);
  }
}

void scale_n(DType dtype, const TensorSpanList& tensors, const void* factor) {
  // Each tensor as update's mul_ runs it: the same bits.
  for (int64_t i = 0; i < tensors.count; ++i) {
    const TensorSpan& t = tensors.data[i];
    const int64_t unit[1] = {1}, none[1] = {0};
    const Operand x{t.data, dtype, unit};
    const Operand f{const_cast<void*>(factor), dtype, none};
    update(UpdateOp::mul, {}, Shape{t.n}, x, f, f);
  }
}

void clip_factor(const double* norms, int64_t count, double p, double max_norm, DType factor_dtype,
                 double* total, void* factor) {
  *total = fn::clip_total(norms, count, p);
  const double f = fn::clip_factor(*total, max_norm);
  dispatch_all(factor_dtype, "clip_grad_norm_", [&](auto tag) {
    using T = typename decltype(tag)::type;
    *static_cast<T*>(factor) = cast<T>(f);  // copy's conversion from f64
  });
}

}  // namespace quanta::cpu
