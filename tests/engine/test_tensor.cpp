#include <doctest/doctest.h>

#include "quanta.h"

using namespace quanta;

TEST_CASE("tensor basics") {
  Tensor a = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  CHECK(a.shape() == Shape{2, 3});
  Tensor b = a.t();
  CHECK_FALSE(b.is_contiguous());
  Tensor c = b.contiguous();
  CHECK(c.to_vector<float>() == std::vector<float>{1, 4, 2, 5, 3, 6});
  Tensor s = sum(a * 2.0);
  CHECK(s.item() == doctest::Approx(42));
}

TEST_CASE("autograd basics") {
  Tensor x = from_vector<double>({1, 2, 3}).requires_grad_();
  Tensor y = sum(exp(x) * x);
  y.backward();
  auto g = x.grad().to_vector<double>();
  for (int i = 0; i < 3; ++i) CHECK(g[i] == doctest::Approx(std::exp(i + 1.0) * (i + 2.0)));
}
