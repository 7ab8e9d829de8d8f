// IncrementalPCA: batch by batch, the running mean and variance are the
// whole data's; with every component kept, the components and singular
// values are the whole data's PCA; truncated, close to it where the
// spectrum has a gap; the randomized SVD close to the exact one and
// replayable; the sign rule; the refusals.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <optional>

#include "quanta.h"
#include "support/relative_error.h"

using namespace quanta;
using namespace quanta::testing;

namespace {

// Rows of a few strong directions plus noise: [n, d] f64, mean away from 0.
Tensor structured_rows(int64_t n, int64_t d, Generator& gen, double noise = 0.05) {
  const Tensor basis = randn({4, d}, gen, {.dtype = DType::f64});
  const Tensor scales = from_vector<double>({6.0, 4.0, 2.5, 1.5}, {1, 4});
  const Tensor weights = randn({n, 4}, gen, {.dtype = DType::f64}) * scales;
  const Tensor shift = randn({1, d}, gen, {.dtype = DType::f64}) * 3.0;
  return matmul(weights, basis) + randn({n, d}, gen, {.dtype = DType::f64}) * noise + shift;
}

// The whole data's principal directions [k, d], each row's entry of
// largest magnitude made positive, and singular values [k].
std::pair<Tensor, Tensor> exact_pca(const Tensor& x, int64_t k) {
  const Tensor centred = x - mean(x, {0}, true);
  const SingularTriplets t = top_singular_triplets(centred, k);
  std::vector<double> vh = t.vh.to_vector<double>();
  const int64_t d = x.size(1);
  for (int64_t c = 0; c < k; ++c) {
    int64_t arg = 0;
    for (int64_t j = 1; j < d; ++j)
      if (std::abs(vh[c * d + j]) > std::abs(vh[c * d + arg])) arg = j;
    if (vh[c * d + arg] < 0)
      for (int64_t j = 0; j < d; ++j) vh[c * d + j] = -vh[c * d + j];
  }
  return {from_vector<double>(vh, {k, d}), t.s};
}

// |cos| of each pair of rows.
std::vector<double> row_cosines(const Tensor& a, const Tensor& b) {
  return abs(sum(a * b, {1})).to_vector<double>();
}

}  // namespace

TEST_CASE("IncrementalPCA: every component kept, batches give the whole data's PCA") {
  Generator gen(3);
  const Tensor x = structured_rows(60, 6, gen);
  IncrementalPCA pca(6);
  CHECK_FALSE(pca.fitted());
  // Batches of different sizes, the data rounded to f32 as activations are.
  for (const auto& [start, stop] :
       std::vector<std::pair<int64_t, int64_t>>{{0, 17}, {17, 30}, {30, 45}, {45, 60}})
    pca.partial_fit(slice(x, 0, start, stop).to(DType::f32));
  CHECK(pca.samples_seen() == 60);
  const Tensor whole = x.to(DType::f32).to(DType::f64);
  CHECK(max_abs(pca.mean() - mean(whole, {0})) < 1e-12);
  const Tensor centred = whole - mean(whole, {0}, true);
  CHECK(max_abs(pca.var() - mean(square(centred), {0})) < 1e-11);
  const auto [components, singular] = exact_pca(whole, 6);
  CHECK(max_abs(pca.components() - components) < 1e-9);
  CHECK(max_rel_diff(pca.singular_values(), singular) < 1e-11);
  // The shares of a full set of components add up to the whole variance.
  CHECK(sum(pca.explained_variance_ratio()).item() == doctest::Approx(1.0).epsilon(1e-12));
  // Orthonormal rows, each with its largest entry positive.
  CHECK(max_abs(matmul(pca.components(), transpose(pca.components(), 0, 1)) -
                eye(6, -1, {.dtype = DType::f64})) < 1e-12);
  const std::vector<double> c = pca.components_values();
  for (int64_t r = 0; r < 6; ++r) {
    double largest = 0;
    for (int64_t j = 0; j < 6; ++j)
      if (std::abs(c[r * 6 + j]) > std::abs(largest)) largest = c[r * 6 + j];
    CHECK(largest > 0);
  }
}

TEST_CASE("IncrementalPCA: truncated, close to the whole data's PCA where the spectrum has a gap") {
  Generator gen(8);
  const Tensor x = structured_rows(400, 24, gen);
  const auto [components, singular] = exact_pca(x, 3);
  IncrementalPCA exact(3);
  IncrementalPCA sketched(3, 4, Generator::named(1, "sketch"));
  for (int64_t b = 0; b < 8; ++b) {
    exact.partial_fit(slice(x, 0, 50 * b, 50 * (b + 1)));
    sketched.partial_fit(slice(x, 0, 50 * b, 50 * (b + 1)).to(DType::f32));
  }
  for (const double cos : row_cosines(exact.components(), components)) CHECK(cos > 0.9999);
  CHECK(max_rel_diff(exact.singular_values(), singular) < 1e-3);
  // The randomized SVD (q = 6, four power iterations) finds the same.
  for (const double cos : row_cosines(sketched.components(), exact.components()))
    CHECK(cos > 0.9999);
  CHECK(max_rel_diff(sketched.explained_variance_ratio(), exact.explained_variance_ratio()) < 1e-4);
  // Replayable: the same sketch stream, the same values.
  IncrementalPCA again(3, 4, Generator::named(1, "sketch"));
  for (int64_t b = 0; b < 8; ++b)
    again.partial_fit(slice(x, 0, 50 * b, 50 * (b + 1)).to(DType::f32));
  CHECK(max_abs(again.components() - sketched.components()) == 0);
}

TEST_CASE("IncrementalPCA: refusals name the problem and leave the fit unchanged") {
  CHECK_THROWS_WITH_AS(IncrementalPCA(0), doctest::Contains("components must be >= 1"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(IncrementalPCA(2, 4), doctest::Contains("sketch generator"),
                       std::invalid_argument);
  Generator gen(1);
  IncrementalPCA pca(3);
  CHECK_THROWS_WITH_AS(pca.partial_fit(randn({4, 2}, gen)),
                       doctest::Contains("3 components of rows with 2 features"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(pca.partial_fit(randn({2, 5}, gen)),
                       doctest::Contains("a batch of 2 rows for 3 components"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(pca.partial_fit(randn({6}, gen)), doctest::Contains("needs rows"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(pca.partial_fit(randn({6, 5}, gen, {.dtype = DType::bf16})),
                       doctest::Contains("f32 or f64"), std::invalid_argument);
  std::vector<float> bad(30, 1.0f);
  bad[7] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH_AS(pca.partial_fit(from_vector<float>(bad, {6, 5})),
                       doctest::Contains("entry (1, 2) of the [6, 5] matrix is not finite"),
                       std::invalid_argument);
  CHECK_FALSE(pca.fitted());
  pca.partial_fit(randn({6, 5}, gen));
  const Tensor before = pca.components();
  CHECK_THROWS_WITH_AS(pca.partial_fit(randn({6, 4}, gen)),
                       doctest::Contains("rows of 4 features after rows of 5"),
                       std::invalid_argument);
  CHECK(pca.samples_seen() == 6);
  CHECK(max_abs(pca.components() - before) == 0);
}

TEST_CASE("IncrementalPCA::partial_fit_all: several fits at once equal one at a time") {
  Generator gen(21);
  const Tensor x = structured_rows(120, 10, gen), y = structured_rows(120, 7, gen);
  for (const int64_t niter : {-1, 2}) {
    INFO("niter ", niter);
    const auto sketch = [&](const char* name) {
      return niter < 0 ? std::optional<Generator>() : Generator::named(4, name);
    };
    IncrementalPCA a(3, niter, sketch("a")), b(2, niter, sketch("b"));
    IncrementalPCA a1(3, niter, sketch("a")), b1(2, niter, sketch("b"));
    for (int64_t i = 0; i < 4; ++i) {
      const Tensor xs = slice(x, 0, 30 * i, 30 * (i + 1)), ys = slice(y, 0, 30 * i, 30 * (i + 1));
      IncrementalPCA::partial_fit_all({&a, &b}, {xs, ys});
      a1.partial_fit(xs);
      b1.partial_fit(ys);
    }
    CHECK(max_abs(a.components() - a1.components()) == 0);
    CHECK(max_abs(b.components() - b1.components()) == 0);
    CHECK(max_abs(b.explained_variance_ratio() - b1.explained_variance_ratio()) == 0);
  }
  IncrementalPCA a(2), b(2, 1, Generator(1));
  CHECK_THROWS_WITH_AS(IncrementalPCA::partial_fit_all({&a}, {x, y}),
                       doctest::Contains("1 fits and 2 batches"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(IncrementalPCA::partial_fit_all({&a, &a}, {x, x}),
                       doctest::Contains("a fit given twice"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(IncrementalPCA::partial_fit_all({&a, &b}, {x, y}),
                       doctest::Contains("different SVDs"), std::invalid_argument);
  // One bad batch: no fit changes, the good one's neither.
  IncrementalPCA c(2);
  CHECK_THROWS_WITH_AS(IncrementalPCA::partial_fit_all({&c, &a}, {x, slice(x, 0, 0, 1)}),
                       doctest::Contains("a batch of 1 rows for 2 components"),
                       std::invalid_argument);
  CHECK_FALSE(a.fitted());
  CHECK_FALSE(c.fitted());
}
