// Views share storage and carry gradients back to their base.
#include <doctest/doctest.h>

#include <algorithm>

#include "engine/ops/harness.h"

using namespace quanta;
using namespace quanta::testing;

namespace {
// Reference for a view: gather values of x at the view's logical positions.
OpCase view_case(std::string name, Shape in, std::function<Tensor(const Tensor&)> op,
                 std::function<Tensor(const Tensor&)> ref, Shape zero = {}) {
  OpCase c;
  c.name = std::move(name);
  c.shapes = {std::move(in)};
  if (!zero.empty()) c.zero_shapes = {std::move(zero)};
  c.op = [op](const Inputs& x) { return op(x[0]); };
  c.reference = [ref](const Inputs& x) { return ref(x[0]); };
  return c;
}

// f64 tensor of `shape` holding `v` (which may be empty).
Tensor from_values(const std::vector<double>& v, const Shape& shape) {
  return from_vector<double>(v, {static_cast<int64_t>(v.size())}).reshape(shape);
}

// x's values in row-major order, 1-d (reshape it to the view's shape).
Tensor flat_ref(const Tensor& x) { return from_values(x.to_vector<double>(), {x.numel()}); }

Tensor transpose_ref(const Tensor& x) {
  auto v = x.to_vector<double>();
  const int64_t r = x.size(0), c = x.size(1);
  std::vector<double> out(v.size());
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) out[j * r + i] = v[i * c + j];
  return from_values(out, {c, r});
}
}  // namespace

TEST_CASE("views through the harness") {
  // Zero-size: [2, 0, 4] holds 0 elements, so -1 is inferred as 0 -> [4, 0].
  run_case(view_case(
      "reshape", {2, 3, 4},
      [](const Tensor& x) {
        return reshape(x, {4, -1});
      },
      [](const Tensor& x) {
        return flat_ref(x).reshape({4, -1});
      },
      {2, 0, 4}));
  run_case(view_case("transpose", {3, 5}, [](const Tensor& x) { return x.t() * 1.0; },
                     transpose_ref, {0, 5}));
  run_case(view_case("permute_contiguous", {3, 5},
                     [](const Tensor& x) {
                       return permute(x, {1, 0}).contiguous();
                     },
                     transpose_ref, {3, 0}));
  // Rows 1, 3, 5 of x, clamped to the rows x has (like PyTorch's slicing).
  auto slice_step_ref = [](const Tensor& x) {
    auto v = x.to_vector<double>();
    const int64_t rows = x.size(0), cols = x.size(1);
    std::vector<double> out;
    int64_t kept = 0;
    for (int64_t i = 1; i < std::min<int64_t>(7, rows); i += 2, ++kept)
      for (int64_t j = 0; j < cols; ++j) out.push_back(v[i * cols + j]);
    return from_values(out, {kept, cols});
  };
  // Zero-size twice: an empty sliced dim (clamped to nothing) and an empty other dim.
  for (Shape zero : {Shape{0, 3}, Shape{7, 0}})
    run_case(view_case(
        "slice_step", {7, 3}, [](const Tensor& x) { return slice(x, 0, 1, 7, 2); }, slice_step_ref,
        zero));
  run_case(view_case(
      "select", {4, 3}, [](const Tensor& x) { return select(x, 1, -1); },
      [](const Tensor& x) {
        auto v = x.to_vector<double>();
        std::vector<double> out;
        for (int64_t i = 0; i < x.size(0); ++i) out.push_back(v[i * 3 + 2]);
        return from_vector<double>(out, {x.size(0)});
      },
      {0, 3}));
  run_case(view_case(
      "narrow", {5, 2}, [](const Tensor& x) { return narrow(x, 0, 1, 3); },
      [](const Tensor& x) {
        auto v = x.to_vector<double>();
        const int64_t cols = x.size(1);
        return from_values(std::vector<double>(v.begin() + cols, v.begin() + 4 * cols), {3, cols});
      },
      {5, 0}));
  // A zero-length narrow; its zero-size variant narrows an empty dim at start 0.
  run_case(view_case(
      "narrow_empty", {5, 2}, [](const Tensor& x) { return narrow(x, 1, 0, 0); },
      [](const Tensor& x) {
        return from_values({}, {x.size(0), 0});
      },
      {0, 0}));
  run_case(view_case(
      "expand", {3, 1},
      [](const Tensor& x) {
        return expand(x, {2, x.size(0), 4});
      },
      [](const Tensor& x) {
        return ref_elementwise({x, zeros({2, x.size(0), 4}, {.dtype = DType::f64})},
                               [](const std::vector<double>& v) { return v[0]; });
      },
      {0, 1}));
  run_case(view_case(
      "squeeze_unsqueeze", {3, 1, 2}, [](const Tensor& x) { return unsqueeze(squeeze(x, 1), 0); },
      [](const Tensor& x) {
        return flat_ref(x).reshape({1, x.size(0), x.size(2)});
      },
      {0, 1, 2}));
  // squeeze() drops every size-1 dim and keeps size-0 ones.
  run_case(view_case(
      "squeeze_all_unsqueeze", {1, 3, 1, 2},
      [](const Tensor& x) { return unsqueeze(squeeze(x), -1); },
      [](const Tensor& x) {
        return flat_ref(x).reshape({x.size(1), x.size(3), 1});
      },
      {1, 0, 1, 2}));
  run_case(view_case(
      "flatten_unflatten", {2, 3, 4},
      [](const Tensor& x) {
        return unflatten(flatten(x, 1), 1, {4, -1});
      },
      [](const Tensor& x) {
        return from_vector<double>(x.to_vector<double>(), {x.numel()}).reshape({x.size(0), 4, -1});
      },
      {2, 0, 4}));
}

TEST_CASE("views share storage; reshape copies only when it must") {
  Tensor x = arange(0, 12, 1, {.dtype = DType::f32}).reshape({3, 4});
  Tensor v = x.view({4, 3});
  CHECK(v.storage() == x.storage());
  Tensor t = x.t();
  CHECK(t.storage() == x.storage());
  CHECK_THROWS_WITH_AS(t.view({12}), doctest::Contains("use reshape"), std::invalid_argument);
  Tensor r = t.reshape({12});
  CHECK(r.storage() != x.storage());
  CHECK(r.to_vector<float>()[1] == 4.0f);
  // A slice of a transpose can still be viewed when the merged dims are contiguous.
  Tensor y = arange(0, 24, 1, {.dtype = DType::f32}).reshape({2, 3, 4}).permute({1, 0, 2});
  CHECK_THROWS_AS(y.view({3, 8}), std::invalid_argument);
  CHECK(y.view({3, 2, 2, 2}).storage() == y.storage());
  CHECK(y.view({3, 2, 2, 2}).contiguous().to_vector<float>() == y.contiguous().to_vector<float>());
  CHECK(y.reshape({3, 8}).to_vector<float>()[4] == 12.0f);
  Tensor e = x.slice(1, 0, 1).expand({3, 5});
  CHECK(e.strides()[1] == 0);
  CHECK_THROWS_AS(x.expand({4, 4}), std::invalid_argument);
  CHECK_THROWS_WITH_AS(x.select(0, 3), doctest::Contains("[select] index 3 out of range"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(x.reshape({5, -1}), doctest::Contains("[reshape]"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(x.permute({0, 0}), doctest::Contains("[permute]"), std::invalid_argument);
  CHECK(x.slice(0, -2, 100).shape() == Shape{2, 4});
  CHECK(x.slice(0, 5, 9).shape() == Shape{0, 4});
}

TEST_CASE("a write through a view is seen by the base") {
  Tensor x = zeros({3, 4});
  fill_(x.select(0, 1), 7.0);
  copy_(x.slice(1, 0, 4, 3), full({3, 2}, 2.0));
  auto v = x.to_vector<float>();
  CHECK(v[4] == 2.0f);
  CHECK(v[5] == 7.0f);
  CHECK(v[7] == 2.0f);
  CHECK(v[0] == 2.0f);
  CHECK(v[1] == 0.0f);
}

TEST_CASE("copies of transposed layouts (tiled) give every element in place, any dtype pair") {
  // Sizes around the 32-wide tiles, a batch dim before, between and after
  // the transposed pair, and conversions on the way.
  const std::vector<std::pair<Shape, std::vector<int64_t>>> cases = {
      {{64, 64}, {1, 0}},
      {{33, 70}, {1, 0}},
      {{100, 31}, {1, 0}},
      {{3, 40, 50}, {0, 2, 1}},
      {{40, 3, 50}, {2, 1, 0}},
      {{40, 50, 3}, {1, 0, 2}},
      {{2, 37, 3, 45}, {0, 3, 2, 1}}};
  for (const auto& [shape, order] : cases) {
    const std::string at = shape_str(shape) + " permuted " + shape_str(order);
    INFO(at);
    const Tensor x = make_input(shape, Domain::any, 31);
    const Tensor p = permute(x, order);
    const std::vector<double> xv = x.to_vector<double>();
    for (const DType to : {DType::f64, DType::f32, DType::bf16, DType::i64}) {
      const Tensor y = contiguous(p.to(to));  // to(): the conversion copy of the strided view
      const Tensor z = contiguous(p).to(to);  // the same values converted after a plain copy
      CHECK(y.is_contiguous());
      CHECK(y.to_vector<double>() == z.to_vector<double>());
    }
    // Element by element against the index arithmetic of the permutation.
    const Tensor y = contiguous(p);
    const std::vector<double> yv = y.to_vector<double>();
    const Shape& ys = y.shape();
    std::vector<int64_t> xstride(shape.size(), 1);
    for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d)
      xstride[d] = xstride[d + 1] * shape[d + 1];
    bool same = true;
    for (int64_t e = 0; e < static_cast<int64_t>(yv.size()); ++e) {
      int64_t rest = e, off = 0;
      for (int d = static_cast<int>(ys.size()) - 1; d >= 0; --d) {
        off += (rest % ys[d]) * xstride[order[d]];
        rest /= ys[d];
      }
      same = same && yv[e] == xv[off];
    }
    CHECK(same);
  }
}
