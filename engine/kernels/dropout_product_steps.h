#pragma once
// KernelTable::dropout_product as three steps any device has: the dropped
// copy (or the masked gradient) made whole by random_fill's bernoulli fill
// with its `times` products, and the products by a GEMM. CUDA runs it this
// way (device memory is fast enough that fusing saves little there), and so
// does the CPU without AVX-512, where its library GEMM is faster than the
// fused kernel's portable loops. The device supplies `Steps`:
//   T* scratch(int64_t n)    n elements of scratch, alive until `Steps` is
//                            destroyed,
//   void fill(const RandomFill& f, int64_t n, void* out)   random_fill,
//   void product(int64_t m, int64_t n, int64_t k, MatOperand a, MatOperand b,
//                void* c)    c [m, n] (row-major) = a b,
//   void add(int64_t n, const void* src, void* dst)   dst[i] += src[i].
#include <cstdint>

#include "engine/kernels/table.h"

namespace quanta {

template <class T, class Steps>
void dropout_product_steps(const DropoutProduct& d, Steps& steps) {
  const int64_t m = d.m, k = d.k, r = d.r;
  RandomFill f = d.mask;
  if (!d.gt) {
    T* xd = steps.scratch(m * k);
    f.times = d.x;
    steps.fill(f, m * k, xd);
    steps.product(m, r, k, {xd, k, 1}, {d.w, 1, k}, d.t);  // xd w^T
    return;
  }
  T* xd = d.gw ? steps.scratch(m * k) : nullptr;
  if (d.gx) {
    T* gxd = steps.scratch(m * k);
    steps.product(m, k, r, {d.gt, r, 1}, {d.w, k, 1}, gxd);  // gt w
    // One draw masks the gradient and (for gw) x alike.
    f.times = gxd;
    if (d.gw) f.times2 = d.x, f.out2 = xd;
    T* masked = d.accumulate_gx ? steps.scratch(m * k) : static_cast<T*>(d.gx);
    steps.fill(f, m * k, masked);
    if (d.accumulate_gx) steps.add(m * k, masked, d.gx);
  } else {
    f.times = d.x;
    steps.fill(f, m * k, xd);
  }
  if (d.gw) steps.product(r, k, m, {d.gt, 1, r}, {xd, k, 1}, d.gw);  // gt^T xd
}

}  // namespace quanta
