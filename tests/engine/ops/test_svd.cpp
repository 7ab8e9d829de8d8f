// top_singular_triplets: the factors' defining properties (orthonormal,
// descending, reconstructing the matrix; the error of a truncation is the
// dropped values' squares), the sign rule, a known decomposition, and the
// refusals.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "quanta.h"
#include "support/relative_error.h"

using namespace quanta;
using namespace quanta::testing;

TEST_CASE("top_singular_triplets: orthonormal factors that rebuild the matrix, in f64 and f32") {
  for (const DType dtype : {DType::f64, DType::f32}) {
    for (const Shape& shape : {Shape{7, 5}, Shape{5, 9}, Shape{6, 6}}) {
      INFO(dtype_name(dtype), " ", shape_str(shape));
      Generator gen(11);
      const Tensor a = randn(shape, gen, {.dtype = dtype});
      const int64_t k = std::min(shape[0], shape[1]);
      const double tol = dtype == DType::f64 ? 1e-12 : 2e-5;
      const SingularTriplets t = top_singular_triplets(a, k);
      CHECK(t.u.shape() == Shape{shape[0], k});
      CHECK(t.s.shape() == Shape{k});
      CHECK(t.vh.shape() == Shape{k, shape[1]});
      CHECK(t.u.dtype() == dtype);
      CHECK(max_rel_diff(matmul(t.u * unsqueeze(t.s, 0), t.vh), a) < tol);
      CHECK(max_abs(matmul(transpose(t.u, 0, 1), t.u) - eye(k, -1, {.dtype = dtype})) < tol);
      CHECK(max_abs(matmul(t.vh, transpose(t.vh, 0, 1)) - eye(k, -1, {.dtype = dtype})) < tol);
      const std::vector<double> s = t.s.to_vector<double>();
      for (std::size_t i = 1; i < s.size(); ++i) CHECK(s[i] <= s[i - 1]);
      CHECK(s.back() >= 0);
      CHECK(t.total_square == doctest::Approx(sum(square(a)).item()).epsilon(tol));
      CHECK(t.rest_square == 0);
      // Each column of u has its entry of largest magnitude positive.
      const std::vector<double> u = t.u.to_vector<double>();
      for (int64_t j = 0; j < k; ++j) {
        double largest = 0;
        for (int64_t i = 0; i < shape[0]; ++i)
          if (std::abs(u[i * k + j]) > std::abs(largest)) largest = u[i * k + j];
        CHECK(largest > 0);
      }
    }
  }
}

TEST_CASE("top_singular_triplets: a truncation leaves the dropped values' squares") {
  Generator gen(5);
  const Tensor a = randn({12, 8}, gen, {.dtype = DType::f64});
  const SingularTriplets all = top_singular_triplets(a, 8);
  const SingularTriplets top = top_singular_triplets(a, 3);
  CHECK(max_rel_diff(top.s, slice(all.s, 0, 0, 3)) < 1e-13);
  CHECK(max_rel_diff(top.u, slice(all.u, 1, 0, 3)) < 1e-12);
  const double dropped = sum(square(slice(all.s, 0, 3, 8))).item();
  CHECK(top.rest_square == doctest::Approx(dropped).epsilon(1e-12));
  const Tensor rest = a - matmul(top.u * unsqueeze(top.s, 0), top.vh);
  CHECK(sum(square(rest)).item() == doctest::Approx(dropped).epsilon(1e-10));
  // The best rank-3 approximation's residual is orthogonal to its columns.
  CHECK(max_abs(matmul(transpose(top.u, 0, 1), rest)) < 1e-12);
}

TEST_CASE("top_singular_triplets: a known decomposition, signs by the largest entry of u") {
  // [[3, 0], [0, -2]]: 3 along (1, 0), 2 along (0, 1) with v = (0, -1).
  const Tensor a = from_vector<double>({3, 0, 0, -2}, {2, 2});
  const SingularTriplets t = top_singular_triplets(a, 2);
  CHECK(t.s.to_vector<double>() == std::vector<double>{3, 2});
  CHECK(t.u.to_vector<double>() == std::vector<double>{1, 0, 0, 1});
  CHECK(t.vh.to_vector<double>() == std::vector<double>{1, 0, 0, -1});
  // u's sign follows a's: the negated matrix flips v, not u.
  const SingularTriplets n = top_singular_triplets(a * -1.0, 1);
  CHECK(n.u.to_vector<double>() == std::vector<double>{1, 0});
  CHECK(n.vh.to_vector<double>() == std::vector<double>{-1, 0});
}

TEST_CASE("top_singular_triplets: results on the matrix's device (sim)") {
  Generator gen(3);
  const Tensor a = randn({6, 4}, gen);
  const SingularTriplets host = top_singular_triplets(a, 2);
  const SingularTriplets sim = top_singular_triplets(a.to(Device::sim()), 2);
  CHECK(sim.u.device() == Device::sim());
  CHECK(sim.s.device() == Device::sim());
  CHECK(sim.vh.to(Device::cpu()).to_vector<float>() == host.vh.to_vector<float>());
}

TEST_CASE("top_singular_triplets: refusals name what is wrong") {
  const Tensor a = zeros({3, 4}, {.dtype = DType::f64});
  CHECK_THROWS_WITH_AS(top_singular_triplets(zeros({2, 2, 2}), 1),
                       doctest::Contains("needs a matrix, got 3 dims"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(top_singular_triplets(a, 0),
                       doctest::Contains("k must be in [1, 3] for a [3, 4] matrix, got 0"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(top_singular_triplets(a, 4), doctest::Contains("got 4"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(top_singular_triplets(zeros({2, 2}, {.dtype = DType::bf16}), 1),
                       doctest::Contains("needs f32 or f64, got bf16"), std::invalid_argument);
  const Tensor bad =
      from_vector<double>({1, 2, 3, std::numeric_limits<double>::quiet_NaN(), 5, 6}, {2, 3});
  CHECK_THROWS_WITH_AS(top_singular_triplets(bad, 1),
                       doctest::Contains("entry (1, 0) of the [2, 3] matrix is not finite"),
                       std::invalid_argument);
}

TEST_CASE("approximate_singular_triplets: torch.svd_lowrank's approximation of the top k") {
  // A [40, 30] matrix with singular values 10, 6, 3, then 0.01 and less:
  // a sketch of 3 columns and a few power iterations find the top three.
  Generator gen(17);
  const ThinQR left = thin_qr(randn({40, 30}, gen, {.dtype = DType::f64}));
  const ThinQR right = thin_qr(randn({30, 30}, gen, {.dtype = DType::f64}));
  std::vector<double> values(30);
  for (int i = 0; i < 30; ++i)
    values[std::size_t(i)] = i < 3 ? 10.0 / (1 + 0.7 * i * i) : 0.01 / (i - 2);
  const Tensor s = from_vector<double>(values, {30});
  const Tensor a = matmul(left.q * unsqueeze(s, 0), transpose(right.q, 0, 1));
  const SingularTriplets exact = top_singular_triplets(a, 3);
  for (const DType dtype : {DType::f64, DType::f32}) {
    INFO(dtype_name(dtype));
    std::vector<Generator> gens{Generator(5)};
    const SingularTriplets t = approximate_singular_triplets({a.to(dtype)}, {3}, 4, gens)[0];
    CHECK(t.u.shape() == Shape{40, 3});
    CHECK(t.vh.shape() == Shape{3, 30});
    CHECK(t.s.dtype() == dtype);
    CHECK(max_rel_diff(t.s, exact.s) < 1e-5);
    CHECK(max_rel_diff(matmul(t.u * unsqueeze(t.s, 0), t.vh),
                       matmul(exact.u * unsqueeze(exact.s, 0), exact.vh)) < 1e-4);
    // The sign rule is top_singular_triplets': the same vectors.
    CHECK(max_rel_diff(t.u, exact.u) < 1e-4);
    // rest_square is the squared distance to the projection, exactly.
    const double rest =
        sum(square(a - matmul(t.u * unsqueeze(t.s, 0), t.vh).to(DType::f64))).item();
    CHECK(t.rest_square == doctest::Approx(rest).epsilon(dtype == DType::f64 ? 1e-9 : 1e-2));
    CHECK(t.total_square == doctest::Approx(exact.total_square).epsilon(1e-6));
  }
  // The generator's state decides the sketch: the same state, the same
  // results; no iterations, a coarser approximation of the same.
  std::vector<Generator> one{Generator(9)}, same{Generator(9)};
  const SingularTriplets x = approximate_singular_triplets({a}, {3}, 2, one)[0];
  const SingularTriplets y = approximate_singular_triplets({a}, {3}, 2, same)[0];
  CHECK(max_abs(x.u - y.u) == 0);
  std::vector<Generator> rough{Generator(9)};
  const SingularTriplets z = approximate_singular_triplets({a}, {3}, 0, rough)[0];
  CHECK(max_rel_diff(z.s, exact.s) > max_rel_diff(x.s, exact.s));
  CHECK(max_rel_diff(z.s, exact.s) < 0.1);
  std::vector<Generator> two{Generator(1), Generator(2)};
  CHECK_THROWS_WITH_AS(approximate_singular_triplets({a}, {3}, 2, two),
                       doctest::Contains("1 matrices, 1 ranks k and 2 generators"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(approximate_singular_triplets({a}, {3}, -1, one),
                       doctest::Contains("niter must be >= 0, got -1"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(approximate_singular_triplets({a}, {31}, 1, one),
                       doctest::Contains("k must be in [1, 30]"), std::invalid_argument);
}
