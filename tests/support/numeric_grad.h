#pragma once
// The finite-difference gradient every differentiable op's f64 check compares
// its backward with.
#include <functional>

#include "quanta.h"

namespace quanta::testing {

/** Central differences (f64) of the scalar `f()` with respect to every
 * element of the contiguous f64 tensor `p` that f reads: each element is moved
 * by +h and -h in place, f evaluated without gradients, and restored. */
inline Tensor numeric_grad(const Tensor& p, const std::function<double()>& f, double h = 1e-6) {
  NoGradGuard no_grad;
  Tensor g = zeros(p.shape(), {.dtype = DType::f64});
  double* pp = p.data<double>();
  double* pg = g.data<double>();
  for (int64_t i = 0; i < p.numel(); ++i) {
    const double keep = pp[i];
    pp[i] = keep + h;
    const double up = f();
    pp[i] = keep - h;
    const double down = f();
    pp[i] = keep;
    pg[i] = (up - down) / (2 * h);
  }
  return g;
}

/** The same for a function of a tensor: the gradient of f at x (x is not
 * modified; f sees a moved f64 copy). */
inline Tensor numeric_grad(const std::function<double(const Tensor&)>& f, const Tensor& x,
                           double h = 1e-6) {
  const Tensor moved = x.detach().to(DType::f64).clone();
  return numeric_grad(
      moved, [&] { return f(moved); }, h);
}

}  // namespace quanta::testing
