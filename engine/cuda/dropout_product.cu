// dropout_product on CUDA: the dropped copy in stream-ordered scratch, then
// the products through cuBLAS (this table's gemm). Device memory is fast
// enough that the CPU's reason to fuse (a pass over x that left the cache)
// is small here; the masks are random_fill's, so the bits are the CPU's.
#include "engine/cuda/kernels.h"
#include "engine/cuda/scratch.h"

namespace quanta::cuda {
namespace {

template <class T>
void run(const DropoutProduct& d) {
  const int64_t m = d.m, k = d.k, r = d.r;
  const DType dt = d.mask.dtype;
  auto product = [&](int64_t pm, int64_t pn, int64_t pk, MatOperand a, MatOperand b, void* c) {
    GemmArgs g;
    g.dtype = dt;
    g.m = pm, g.n = pn, g.k = pk;
    g.a = a, g.b = b;
    g.c = c, g.ldc = pn;
    gemm(g);
  };
  RandomFill f = d.mask;
  if (!d.gt) {
    const Scratch<T> xd(m * k);
    f.times = d.x;
    random_fill(f, m * k, xd.get());
    product(m, r, k, {xd.get(), k, 1}, {d.w, 1, k}, d.t);  // xd w^T
    return;
  }
  const Scratch<T> xd(d.gw ? m * k : 0), gxd(d.gx ? m * k : 0);
  if (d.gx) {
    product(m, k, r, {d.gt, r, 1}, {d.w, k, 1}, gxd.get());  // gt w
    f.times = gxd.get();
    if (d.gw) f.times2 = d.x, f.out2 = xd.get();
    random_fill(f, m * k, d.gx);
  } else {
    f.times = d.x;
    random_fill(f, m * k, xd.get());
  }
  if (d.gw) product(r, k, m, {d.gt, 1, r}, {xd.get(), k, 1}, d.gw);  // gt^T xd
}

}  // namespace

void dropout_product(const DropoutProduct& d) {
  if (d.m == 0) return;
  if (d.mask.dtype == DType::f64) return run<double>(d);
  run<float>(d);
}

}  // namespace quanta::cuda
