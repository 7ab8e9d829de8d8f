// Adaptive average pooling and linear interpolation against PyTorch's values
// (F.adaptive_avg_pool{1,2}d, F.interpolate align_corners=False, computed in
// f64) and finite differences.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "quant/hierarchical/resample.h"
#include "quanta.h"
#include "support/numeric_grad.h"

using namespace quanta;
using namespace quanta::quant;
using quanta::testing::numeric_grad;

namespace {

double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = a.size() == b.size() ? 0.0 : 1e300;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// x = arange(70) ** 1.5 / 10 as [1, 2, 5, 7]: uneven windows in both dims.
Tensor image() {
  std::vector<double> v(70);
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::pow(static_cast<double>(i), 1.5) / 10;
  return from_vector(v, {1, 2, 5, 7});
}

}  // namespace

TEST_CASE("adaptive_avg_pool_nd and interpolate_linear_nd: 1-d as PyTorch") {
  const Tensor y = from_vector(std::vector<double>{1, 4, 2, 8, 5}, {1, 1, 5});
  CHECK(max_diff(adaptive_avg_pool_nd(y, {3}).to_vector<double>(), {2.5, 4.666666666666667, 6.5}) <
        1e-12);
  CHECK(max_diff(interpolate_linear_nd(y, {8}).to_vector<double>(),
                 {1.0, 2.3125, 3.875, 2.625, 3.875, 7.625, 6.3125, 5.0}) < 1e-12);
  // Equal sizes are the identity for both.
  CHECK(max_diff(adaptive_avg_pool_nd(y, {5}).to_vector<double>(), y.to_vector<double>()) == 0);
  CHECK(max_diff(interpolate_linear_nd(y, {5}).to_vector<double>(), y.to_vector<double>()) == 0);
  // Pooling to one is the mean; interpolating one value repeats it.
  CHECK(adaptive_avg_pool_nd(y, {1}).to_vector<double>()[0] == doctest::Approx(4.0));
  CHECK(max_diff(interpolate_linear_nd(from_vector(std::vector<double>{3}, {1, 1, 1}), {4})
                     .to_vector<double>(),
                 {3, 3, 3, 3}) < 1e-15);
}

TEST_CASE("adaptive_avg_pool_nd and interpolate_linear_nd: 2-d as PyTorch") {
  const Tensor pooled = adaptive_avg_pool_nd(image(), {3, 4});
  CHECK(pooled.shape() == Shape{1, 2, 3, 4});
  const std::vector<double> expect_pool = {
      1.0536919043855413, 1.5045795524517687, 2.234189349790864,  2.8579666076720738,
      5.8508144348926026, 6.716739098157393,  7.9344921290574595, 8.89289679594068,
      12.593877228417645, 13.735933688534695, 15.305676892904112, 16.517338863174665,
      24.43059395716507,  25.850199346543135, 27.780949821148536, 29.256995695507268,
      35.0020091100084,   36.59653989145261,  38.75648276017249,  40.401524913537465,
      46.536329698008046, 48.29127150700278,  50.661972773414554, 52.462828251109684};
  CHECK(max_diff(pooled.to_vector<double>(), expect_pool) < 1e-12);
  // Back up to [5, 7], bilinear: the first row of each channel and a middle one.
  const std::vector<double> up = interpolate_linear_nd(pooled, {5, 7}).to_vector<double>();
  REQUIRE(up.size() == 70);
  const std::vector<double> expect_row0 = {
      1.0536919043855413, 1.2147232072663368, 1.4723732918756096, 1.8693844511213165,
      2.2787448682109503, 2.6351890155716418, 2.8579666076720738};
  const std::vector<double> expect_row3 = {
      9.896652111007628,  10.265082018641966, 10.854569870856905, 11.642729419874613,
      12.436514348002278, 13.07100523309692,  13.467562036281072};
  const std::vector<double> expect_last = {46.536329698008046, 47.16309462979188, 48.16591852064601,
                                           49.476622140208676, 50.79060530753564, 51.81966558050428,
                                           52.462828251109684};
  CHECK(max_diff({up.begin(), up.begin() + 7}, expect_row0) < 1e-12);
  CHECK(max_diff({up.begin() + 21, up.begin() + 28}, expect_row3) < 1e-12);
  CHECK(max_diff({up.begin() + 63, up.end()}, expect_last) < 1e-12);
}

TEST_CASE("adaptive_avg_pool_nd and interpolate_linear_nd: gradients match finite differences") {
  Tensor x = image().to(DType::f64);
  std::vector<double> wv(2 * 3 * 4 * 2);
  for (size_t i = 0; i < wv.size(); ++i) wv[i] = std::sin(0.7 * static_cast<double>(i) + 0.3);
  // 3-d: [1, 2, 5, 7] seen as [1, 1, 2, 5, 7], pooled to [2, 3, 4], resized to [1, 4, 9].
  for (const bool pool : {true, false}) {
    CAPTURE(pool);
    const Tensor x3 = reshape(x, {1, 1, 2, 5, 7}).clone();
    const Shape out_shape = pool ? Shape{1, 1, 2, 3, 4} : Shape{1, 1, 1, 4, 9};
    std::vector<double> wv2(static_cast<size_t>(numel_of(out_shape)));
    for (size_t i = 0; i < wv2.size(); ++i) wv2[i] = std::cos(0.37 * static_cast<double>(i));
    const Tensor w = from_vector(wv2, out_shape);
    auto apply = [&](const Tensor& t) {
      return pool ? adaptive_avg_pool_nd(t, {2, 3, 4}) : interpolate_linear_nd(t, {1, 4, 9});
    };
    Tensor leaf = x3.clone().requires_grad_(true);
    sum(mul(apply(leaf), w)).backward();
    const Tensor numeric =
        numeric_grad([&](const Tensor& t) { return sum(mul(apply(t), w)).item<double>(); }, x3);
    CHECK(max_diff(leaf.grad().to_vector<double>(), numeric.to_vector<double>()) < 1e-7);
  }
}

TEST_CASE("adaptive_avg_pool_nd and interpolate_linear_nd: empty batches and bad shapes") {
  CHECK(adaptive_avg_pool_nd(zeros({0, 3, 6}), {2}).shape() == Shape{0, 3, 2});
  CHECK(interpolate_linear_nd(zeros({0, 3, 2, 2}), {4, 5}).shape() == Shape{0, 3, 4, 5});
  CHECK_THROWS_AS(adaptive_avg_pool_nd(zeros({1, 3, 6}), {2, 2}), std::invalid_argument);
  CHECK_THROWS_AS(interpolate_linear_nd(zeros({1, 3, 6}), {0}), std::invalid_argument);
}

TEST_CASE("ResampleMatrices: each matrix is built once per shape, dtype and device") {
  ResampleMatrices held;
  const Tensor x = image();
  const Tensor pooled = adaptive_avg_pool_nd(x, {3, 4}, &held);
  CHECK(held.size() == 2);  // one per dim whose size changes
  CHECK(max_diff(pooled.to_vector<double>(), adaptive_avg_pool_nd(x, {3, 4}).to_vector<double>()) ==
        0);
  // The same shapes again reuse them; interpolation's are other matrices.
  CHECK(max_diff(adaptive_avg_pool_nd(x * 2.0, {3, 4}, &held).to_vector<double>(),
                 (pooled * 2.0).to_vector<double>()) < 1e-12);
  CHECK(held.size() == 2);
  const Tensor up = interpolate_linear_nd(pooled, {5, 7}, &held);
  CHECK(held.size() == 4);
  CHECK(max_diff(up.to_vector<double>(),
                 interpolate_linear_nd(pooled, {5, 7}).to_vector<double>()) == 0);
  // Another dtype is another matrix, and the result keeps the input's dtype.
  const Tensor pooled32 = adaptive_avg_pool_nd(to_dtype(x, DType::f32), {3, 4}, &held);
  CHECK(pooled32.dtype() == DType::f32);
  CHECK(held.size() == 6);
  CHECK(max_diff(to_dtype(pooled32, DType::f64).to_vector<double>(), pooled.to_vector<double>()) <
        1e-4);
}
