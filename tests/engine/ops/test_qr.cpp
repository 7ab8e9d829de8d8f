// thin_qr: orthonormal q, upper-triangular r that rebuild the matrix, for
// tall, wide and square matrices in f64 and f32; LAPACK's sign rule (a
// known factorization); several at once equal one at a time; the refusals.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "quanta.h"
#include "support/relative_error.h"

using namespace quanta;
using namespace quanta::testing;

TEST_CASE("thin_qr: orthonormal q and upper-triangular r that rebuild the matrix") {
  for (const DType dtype : {DType::f64, DType::f32}) {
    for (const Shape& shape : {Shape{7, 5}, Shape{5, 9}, Shape{6, 6}}) {
      INFO(dtype_name(dtype), " ", shape_str(shape));
      Generator gen(21);
      const Tensor a = randn(shape, gen, {.dtype = dtype});
      const int64_t p = std::min(shape[0], shape[1]);
      const double tol = dtype == DType::f64 ? 1e-12 : 2e-5;
      const ThinQR f = thin_qr(a);
      CHECK(f.q.shape() == Shape{shape[0], p});
      CHECK(f.r.shape() == Shape{p, shape[1]});
      CHECK(f.q.dtype() == dtype);
      CHECK(max_rel_diff(matmul(f.q, f.r), a) < tol);
      CHECK(max_abs(matmul(transpose(f.q, 0, 1), f.q) - eye(p, -1, {.dtype = dtype})) < tol);
      const std::vector<double> r = f.r.to_vector<double>();
      for (int64_t i = 0; i < p; ++i)
        for (int64_t j = 0; j < i; ++j) CHECK(r[std::size_t(i * shape[1] + j)] == 0);
    }
  }
}

TEST_CASE("thin_qr: LAPACK's signs, so PyTorch's factors") {
  // Householder with beta = -sign(a11) ||a1||: [[3, 1], [4, 2]] has
  // r11 = -5, as torch.linalg.qr gives it.
  const Tensor a = from_vector<double>({3, 1, 4, 2}, {2, 2});
  const ThinQR f = thin_qr(a);
  CHECK(f.r.to_vector<double>()[0] == doctest::Approx(-5));
  CHECK(f.q.to_vector<double>()[0] == doctest::Approx(-0.6));
  CHECK(f.q.to_vector<double>()[2] == doctest::Approx(-0.8));
  CHECK(f.r.to_vector<double>()[1] == doctest::Approx(-2.2));
  CHECK(f.r.to_vector<double>()[3] == doctest::Approx(0.4));
}

TEST_CASE("thin_qr: several matrices at once, each as alone; the refusals") {
  Generator gen(4);
  std::vector<Tensor> many;
  for (int i = 0; i < 5; ++i) many.push_back(randn({8 + i, 6}, gen));
  const std::vector<ThinQR> together = thin_qr(many);
  REQUIRE(together.size() == many.size());
  for (std::size_t i = 0; i < many.size(); ++i) {
    const ThinQR alone = thin_qr(many[i]);
    CHECK(max_abs(alone.q - together[i].q) == 0);
    CHECK(max_abs(alone.r - together[i].r) == 0);
  }
  CHECK_THROWS_WITH_AS(thin_qr(randn({2, 3, 4}, gen)), doctest::Contains("needs a matrix"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(thin_qr(zeros({3, 2}, {.dtype = DType::bf16})),
                       doctest::Contains("needs f32 or f64, got bf16"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(thin_qr(zeros({0, 2})), doctest::Contains("is empty"),
                       std::invalid_argument);
  Tensor bad = zeros({2, 2});
  bad = bad + from_vector<float>({0, std::numeric_limits<float>::quiet_NaN(), 0, 0}, {2, 2});
  CHECK_THROWS_WITH_AS(thin_qr(bad), doctest::Contains("entry (0, 1) of the [2, 2] matrix"),
                       std::invalid_argument);
}
