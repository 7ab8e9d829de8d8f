// Checks that a project using quanta as a Meson subproject can build tensors,
// run autograd and get the right numbers. Exits 0 on success.
#include <cmath>
#include <cstdio>
#include <vector>

#include "quanta.h"

using namespace quanta;

namespace {

int failures = 0;

void expect_near(const char* what, double got, double want, double tol) {
  if (std::abs(got - want) > tol) {
    std::printf("FAIL %s: got %.9g, expected %.9g\n", what, got, want);
    ++failures;
  }
}

}  // namespace

int main() {
  // d/dx sum(exp(x) * x) = exp(x) * (x + 1), through a graph of three ops.
  Tensor x = from_vector<double>({0.5, 1.0, 2.0}).requires_grad_();
  Tensor y = sum(exp(x) * x);
  y.backward();
  std::vector<double> g = x.grad().to_vector<double>();
  for (int i = 0; i < 3; ++i) {
    double xi = std::vector<double>{0.5, 1.0, 2.0}[i];
    expect_near("grad of sum(exp(x) * x)", g[i], std::exp(xi) * (xi + 1), 1e-12);
  }

  // Views share storage and broadcasting follows NumPy: column sums of a
  // transposed 2x3 tensor, then the gradient of a broadcast product.
  Tensor a = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  expect_near("sum(a.t() * 2)", sum(a.t() * 2.0).item(), 42.0, 1e-6);
  Tensor w = ones({3}, {.requires_grad = true});
  sum(a * w).backward();
  std::vector<float> gw = w.grad().to_vector<float>();
  expect_near("grad of broadcast w", gw[0] + gw[1] + gw[2], 21.0, 1e-6);

  if (failures == 0) std::printf("quanta consumer: ok\n");
  return failures == 0 ? 0 : 1;
}
