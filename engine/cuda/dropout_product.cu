// dropout_product on CUDA: the table's steps (engine/kernels/
// dropout_product_steps.h) with stream-ordered scratch, this table's
// random_fill and cuBLAS through its gemm, so the masks are the CPU's bits.
#include <memory>
#include <vector>

#include "engine/cuda/kernels.h"
#include "engine/cuda/scratch.h"
#include "engine/kernels/dropout_product_steps.h"

namespace quanta::cuda {
namespace {

template <class T>
struct Steps {
  DType dtype;
  std::vector<std::unique_ptr<Scratch<T>>> held;
  T* scratch(int64_t n) { return held.emplace_back(std::make_unique<Scratch<T>>(n))->get(); }
  void fill(const RandomFill& f, int64_t n, void* out) { random_fill(f, n, out); }
  void product(int64_t m, int64_t n, int64_t k, MatOperand a, MatOperand b, void* c) {
    GemmArgs g;
    g.dtype = dtype;
    g.m = m, g.n = n, g.k = k;
    g.a = a, g.b = b;
    g.c = c, g.ldc = n;
    gemm(g);
  }
  void add(int64_t n, const void* src, void* dst) {
    const int64_t one = 1;
    const Operand from{const_cast<void*>(src), dtype, &one};
    update(UpdateOp::add_scaled, ScalarArgs{1.0, 0.0}, Shape{n}, Operand{dst, dtype, &one}, from,
           from);
  }
};

template <class T>
void run(const DropoutProduct& d) {
  Steps<T> steps{d.mask.dtype, {}};
  dropout_product_steps<T>(d, steps);
}

}  // namespace

void dropout_product(const DropoutProduct& d) {
  if (d.m == 0) return;
  if (d.mask.dtype == DType::f64) return run<double>(d);
  run<float>(d);
}

}  // namespace quanta::cuda
