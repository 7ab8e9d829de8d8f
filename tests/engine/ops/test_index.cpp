// Indexing and joining ops: harness rows for every differentiable op, then
// direct tests of duplicates, bounds errors, split/chunk sizes, pad crops,
// zero-size pieces, masked_select order and embedding's padding_idx.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>

#include "engine/ops/harness.h"
#include "support/gpu.h"

using namespace quanta;
using namespace quanta::testing;

namespace {

uint64_t next_rand(uint64_t& s) {
  s = s * 6364136223846793005ull + 1442695040888963407ull;
  return s >> 33;
}

Tensor i64(const std::vector<int64_t>& v, const Shape& shape = {}) {
  return from_vector<int64_t>(v, shape.empty() ? Shape{static_cast<int64_t>(v.size())} : shape);
}

Tensor f64(const std::vector<double>& v, const Shape& shape = {}) {
  return from_vector<double>(v, shape.empty() ? Shape{static_cast<int64_t>(v.size())} : shape);
}

Tensor from_values(const std::vector<double>& v, const Shape& shape) {
  return from_vector<double>(v, {static_cast<int64_t>(v.size())}).reshape(shape);
}

// Random indices in [0, bound): duplicates are the norm.
InputSpec index_in(int64_t bound) {
  return InputSpec{.make =
                       [bound](const Shape& s, uint64_t seed) {
                         std::vector<int64_t> v(static_cast<size_t>(numel_of(s)));
                         uint64_t st = seed;
                         for (auto& x : v) x = static_cast<int64_t>(next_rand(st) % bound);
                         return i64(v, {static_cast<int64_t>(v.size())}).reshape(s);
                       },
                   .differentiable = false};
}

// Indices in [0, bound) that never repeat along `dim` (scatter overwrites, so
// duplicates there would make the gradient ill-defined).
InputSpec unique_index_in(int64_t dim, int64_t bound) {
  return InputSpec{.make =
                       [dim, bound](const Shape& s, uint64_t seed) {
                         const int64_t d = dim < 0 ? dim + static_cast<int64_t>(s.size()) : dim;
                         std::map<int64_t, std::vector<int64_t>> perms;
                         uint64_t st = seed;
                         std::vector<int64_t> v(static_cast<size_t>(numel_of(s)));
                         for (int64_t i = 0; i < static_cast<int64_t>(v.size()); ++i) {
                           auto pos = unravel(i, s);
                           const int64_t j = pos[d];
                           pos[d] = 0;
                           auto& p = perms[ravel(pos, s)];
                           if (p.empty()) {
                             for (int64_t k = 0; k < bound; ++k) p.push_back(k);
                             for (int64_t k = bound - 1; k > 0; --k)
                               std::swap(p[k], p[next_rand(st) % (k + 1)]);
                           }
                           v[i] = p[j];
                         }
                         return i64(v, {static_cast<int64_t>(v.size())}).reshape(s);
                       },
                   .differentiable = false};
}

InputSpec bool_mask() {
  return InputSpec{.make =
                       [](const Shape& s, uint64_t seed) {
                         return gt(make_input(s, Domain::any, seed),
                                   scalar(0.3, {.dtype = DType::f64}));
                       },
                   .differentiable = false};
}

int64_t wrap(int64_t d, int64_t nd) { return d < 0 ? d + nd : d; }

// ---- naive references (plain loops over to_vector<double>) ----

Tensor ref_index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  const int64_t d = wrap(dim, x.dim());
  auto xv = x.to_vector<double>();
  auto iv = index.to_vector<int64_t>();
  Shape out_shape = x.shape();
  out_shape[d] = static_cast<int64_t>(iv.size());
  std::vector<double> out(static_cast<size_t>(numel_of(out_shape)));
  for (int64_t i = 0; i < numel_of(out_shape); ++i) {
    auto pos = unravel(i, out_shape);
    pos[d] = iv[pos[d]];
    out[i] = xv[ravel(pos, x.shape())];
  }
  return from_values(out, out_shape);
}

Tensor ref_gather(const Tensor& x, int64_t dim, const Tensor& index) {
  const int64_t d = wrap(dim, x.dim());
  auto xv = x.to_vector<double>();
  auto iv = index.to_vector<int64_t>();
  std::vector<double> out(iv.size());
  for (int64_t i = 0; i < index.numel(); ++i) {
    auto pos = unravel(i, index.shape());
    pos[d] = iv[i];
    out[i] = xv[ravel(pos, x.shape())];
  }
  return from_values(out, index.shape());
}

// mode 0: overwrite with src, 1: add src, 2: overwrite with `value`.
Tensor ref_scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src, int mode,
                   double value = 0) {
  const int64_t d = wrap(dim, x.dim());
  auto out = x.to_vector<double>();
  auto iv = index.to_vector<int64_t>();
  std::vector<double> sv = src.defined() ? src.to_vector<double>() : std::vector<double>{};
  for (int64_t i = 0; i < index.numel(); ++i) {
    auto pos = unravel(i, index.shape());
    const double v = mode == 2 ? value : sv[ravel(pos, src.shape())];
    pos[d] = iv[i];
    double& t = out[ravel(pos, x.shape())];
    t = mode == 1 ? t + v : v;
  }
  return from_values(out, x.shape());
}

Tensor ref_index_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
                     double alpha) {
  const int64_t d = wrap(dim, x.dim());
  auto out = x.to_vector<double>();
  auto iv = index.to_vector<int64_t>();
  auto sv = src.to_vector<double>();
  for (int64_t i = 0; i < src.numel(); ++i) {
    auto pos = unravel(i, src.shape());
    pos[d] = iv[pos[d]];
    out[ravel(pos, x.shape())] += alpha * sv[i];
  }
  return from_values(out, x.shape());
}

// Values of x and mask at every position of their broadcast shape.
std::pair<std::vector<double>, std::vector<double>> broadcast_pair(const Tensor& x, const Tensor& m,
                                                                   Shape* shape) {
  *shape = broadcast_shapes(x.shape(), m.shape(), "ref");
  std::vector<double> xs, ms;
  ref_elementwise({x, m.to(DType::f64)}, [&](const std::vector<double>& v) {
    xs.push_back(v[0]);
    ms.push_back(v[1]);
    return 0.0;
  });
  return {xs, ms};
}

Tensor ref_cat(const Inputs& xs, int64_t dim) {
  const int64_t d = wrap(dim, xs[0].dim());
  Shape out_shape = xs[0].shape();
  out_shape[d] = 0;
  for (const auto& x : xs) out_shape[d] += x.shape()[d];
  std::vector<double> out(static_cast<size_t>(numel_of(out_shape)));
  int64_t off = 0;
  for (const auto& x : xs) {
    auto v = x.to_vector<double>();
    for (int64_t i = 0; i < x.numel(); ++i) {
      auto pos = unravel(i, x.shape());
      pos[d] += off;
      out[ravel(pos, out_shape)] = v[i];
    }
    off += x.shape()[d];
  }
  return from_values(out, out_shape);
}

OpCase make_case(std::string name, std::vector<Shape> shapes, OpFn op, OpFn ref,
                 std::vector<InputSpec> inputs = {}, std::vector<Shape> zero = {}) {
  OpCase c;
  c.name = std::move(name);
  c.shapes = std::move(shapes);
  c.op = std::move(op);
  c.reference = std::move(ref);
  c.inputs = std::move(inputs);
  c.zero_shapes = std::move(zero);
  return c;
}

std::vector<int64_t> sizes_along(const std::vector<Tensor>& pieces, int64_t dim) {
  std::vector<int64_t> s;
  for (const auto& p : pieces) s.push_back(p.size(dim));
  return s;
}

}  // namespace

// ---------------------------------------------------------------- harness rows

TEST_CASE("index_select and gather through the harness") {
  run_case(make_case(
      "index_select_dim0", {{4, 5}, {6}},
      [](const Inputs& x) { return index_select(x[0], 0, x[1]); },
      [](const Inputs& x) { return ref_index_select(x[0], 0, x[1]); }, {InputSpec{}, index_in(4)},
      {{4, 0}, {3}}));
  run_case(make_case(
      "index_select_dim-1", {{2, 3, 5}, {7}},
      [](const Inputs& x) { return index_select(x[0], -1, x[1]); },
      [](const Inputs& x) { return ref_index_select(x[0], -1, x[1]); }, {InputSpec{}, index_in(5)},
      {{2, 3, 5}, {0}}));
  run_case(make_case(
      "gather_dim1", {{3, 5}, {3, 4}}, [](const Inputs& x) { return gather(x[0], 1, x[1]); },
      [](const Inputs& x) { return ref_gather(x[0], 1, x[1]); }, {InputSpec{}, index_in(5)},
      {{0, 5}, {0, 4}}));
  run_case(make_case(
      "gather_dim0_small_index", {{4, 3}, {6, 2}},
      [](const Inputs& x) { return gather(x[0], 0, x[1]); },
      [](const Inputs& x) { return ref_gather(x[0], 0, x[1]); }, {InputSpec{}, index_in(4)}));
  run_case(make_case(
      "gather_3d_dim-2", {{2, 3, 4}, {2, 5, 3}},
      [](const Inputs& x) { return gather(x[0], -2, x[1]); },
      [](const Inputs& x) { return ref_gather(x[0], -2, x[1]); }, {InputSpec{}, index_in(3)},
      {{2, 3, 4}, {2, 0, 3}}));
}

TEST_CASE("scatter, scatter_add and index_add through the harness") {
  run_case(make_case(
      "scatter_dim0", {{4, 5}, {3, 5}, {3, 5}},
      [](const Inputs& x) { return scatter(x[0], 0, x[1], x[2]); },
      [](const Inputs& x) { return ref_scatter(x[0], 0, x[1], x[2], 0); },
      {InputSpec{}, unique_index_in(0, 4), InputSpec{}}, {{0, 5}, {0, 5}, {0, 5}}));
  run_case(make_case(
      "scatter_larger_src_dim-1", {{3, 5}, {2, 3}, {3, 4}},
      [](const Inputs& x) { return scatter(x[0], -1, x[1], x[2]); },
      [](const Inputs& x) { return ref_scatter(x[0], -1, x[1], x[2], 0); },
      {InputSpec{}, unique_index_in(-1, 5), InputSpec{}}));
  run_case(make_case(
      "scatter_value", {{4, 5}, {4, 3}},
      [](const Inputs& x) { return scatter(x[0], 1, x[1], 2.5); },
      [](const Inputs& x) { return ref_scatter(x[0], 1, x[1], Tensor(), 2, 2.5); },
      {InputSpec{}, unique_index_in(1, 5)}, {{0, 5}, {0, 3}}));
  run_case(make_case(
      "scatter_add_dim0_duplicates", {{4, 5}, {6, 5}, {6, 5}},
      [](const Inputs& x) { return scatter_add(x[0], 0, x[1], x[2]); },
      [](const Inputs& x) { return ref_scatter(x[0], 0, x[1], x[2], 1); },
      {InputSpec{}, index_in(4), InputSpec{}}, {{4, 5}, {0, 5}, {0, 5}}));
  run_case(make_case(
      "scatter_add_larger_src_3d", {{2, 4, 3}, {2, 3, 2}, {2, 4, 3}},
      [](const Inputs& x) { return scatter_add(x[0], 2, x[1], x[2]); },
      [](const Inputs& x) { return ref_scatter(x[0], 2, x[1], x[2], 1); },
      {InputSpec{}, index_in(3), InputSpec{}}));
  run_case(make_case(
      "index_add_dim0_duplicates", {{5, 3}, {7}, {7, 3}},
      [](const Inputs& x) { return index_add(x[0], 0, x[1], x[2]); },
      [](const Inputs& x) { return ref_index_add(x[0], 0, x[1], x[2], 1.0); },
      {InputSpec{}, index_in(5), InputSpec{}}, {{5, 0}, {7}, {7, 0}}));
  run_case(make_case(
      "index_add_dim-2_alpha", {{2, 4, 3}, {5}, {2, 5, 3}},
      [](const Inputs& x) { return index_add(x[0], -2, x[1], x[2], -0.5); },
      [](const Inputs& x) { return ref_index_add(x[0], -2, x[1], x[2], -0.5); },
      {InputSpec{}, index_in(4), InputSpec{}}, {{2, 4, 3}, {0}, {2, 0, 3}}));
}

TEST_CASE("masked_fill, masked_select and embedding through the harness") {
  OpCase fill = make_case(
      "masked_fill", {{3, 4}, {3, 4}},
      [](const Inputs& x) { return masked_fill(x[0], x[1], -1.5); },
      [](const Inputs& x) {
        return ref_elementwise({x[0], x[1].to(DType::f64)}, [](const std::vector<double>& v) {
          return v[1] != 0 ? -1.5 : v[0];
        });
      },
      {InputSpec{}, bool_mask()}, {{0, 4}, {4}});
  fill.broadcast_shapes = {{3, 1}, {2, 3, 4}};
  run_case(fill);

  OpCase sel = make_case(
      "masked_select", {{3, 4}, {3, 4}}, [](const Inputs& x) { return masked_select(x[0], x[1]); },
      [](const Inputs& x) {
        Shape s;
        auto [xs, ms] = broadcast_pair(x[0], x[1], &s);
        std::vector<double> out;
        for (size_t i = 0; i < xs.size(); ++i)
          if (ms[i] != 0) out.push_back(xs[i]);
        return f64(out, {static_cast<int64_t>(out.size())});
      },
      {InputSpec{}, bool_mask()}, {{0, 4}, {1, 4}});
  sel.broadcast_shapes = {{3, 1}, {2, 3, 4}};
  run_case(sel);

  run_case(make_case(
      "embedding", {{6, 3}, {2, 4}}, [](const Inputs& x) { return embedding(x[0], x[1]); },
      [](const Inputs& x) {
        Tensor flat = ref_index_select(x[0], 0, x[1].reshape({-1}));
        return flat.reshape({x[1].size(0), x[1].size(1), 3});
      },
      {InputSpec{}, index_in(6)}, {{6, 3}, {0, 4}}));
}

TEST_CASE("cat, stack, split and chunk through the harness") {
  run_case(make_case(
      "cat_dim0", {{2, 3}, {4, 3}, {1, 3}}, [](const Inputs& x) { return cat(x, 0); },
      [](const Inputs& x) { return ref_cat(x, 0); }, {}, {{0, 3}, {2, 3}, {0, 3}}));
  run_case(make_case(
      "cat_dim-1_with_empty_piece", {{3, 2}, {3, 0}, {3, 4}},
      [](const Inputs& x) { return cat(x, -1); }, [](const Inputs& x) { return ref_cat(x, -1); },
      {}, {{0, 2}, {0, 0}, {0, 4}}));
  run_case(make_case(
      "stack_dim1", {{3, 4}, {3, 4}, {3, 4}}, [](const Inputs& x) { return stack(x, 1); },
      [](const Inputs& x) {
        Inputs u;
        for (const auto& t : x) u.push_back(t.unsqueeze(1));
        return ref_cat(u, 1);
      },
      {}, {{0, 4}, {0, 4}, {0, 4}}));
  run_case(make_case(
      "stack_dim-1", {{2, 3}, {2, 3}}, [](const Inputs& x) { return stack(x, -1); },
      [](const Inputs& x) {
        return ref_cat({x[0].unsqueeze(-1), x[1].unsqueeze(-1)}, -1);
      }));
  // Pieces are used in a scrambled order with different weights so that a
  // backward that mixed them up would show.
  auto scramble = [](const std::vector<Tensor>& p) {
    Inputs used;
    for (size_t i = p.size(); i-- > 0;) used.push_back(p[i] * static_cast<double>(i + 1));
    return used;
  };
  run_case(make_case(
      "split_size", {{7, 3}},
      [scramble](const Inputs& x) { return cat(scramble(split(x[0], 3, 0)), 0); },
      [scramble](const Inputs& x) {
        std::vector<Tensor> pieces;
        const int64_t n = x[0].size(0);
        for (int64_t at = 0; at < n; at += 3)
          pieces.push_back(x[0].narrow(0, at, std::min<int64_t>(3, n - at)));
        if (n == 0) pieces.push_back(x[0]);
        return ref_cat(scramble(pieces), 0);
      },
      {}, {{0, 3}}));
  run_case(make_case(
      "split_sizes_dim-1", {{2, 6}},
      [scramble](const Inputs& x) {
        return cat(scramble(split(x[0], {1, 0, 5}, -1)), -1);
      },
      [scramble](const Inputs& x) {
        return ref_cat(scramble({x[0].narrow(1, 0, 1), x[0].narrow(1, 1, 0), x[0].narrow(1, 1, 5)}),
                       -1);
      }));
  // chunk(x, 2, 1): pieces of ceil(n / 2) columns, the last one shorter;
  // torch.chunk gives an empty dim `chunks` empty pieces.
  auto chunk_ref = [scramble](const Inputs& x) {
    const int64_t n = x[0].size(1), step = (n + 1) / 2;
    std::vector<Tensor> pieces;
    for (int64_t at = 0; at < n; at += step)
      pieces.push_back(x[0].narrow(1, at, std::min(step, n - at)));
    if (n == 0) pieces = {x[0], x[0]};
    return ref_cat(scramble(pieces), 1);
  };
  // Zero-size both ways: no rows (pieces [0, 3] and [0, 2]) and no columns.
  for (Shape zero : {Shape{0, 5}, Shape{3, 0}})
    run_case(make_case("chunk", {{3, 5}},
                       [scramble](const Inputs& x) { return cat(scramble(chunk(x[0], 2, 1)), 1); },
                       chunk_ref, {}, {zero}));
}

TEST_CASE("flip, repeat and pad through the harness") {
  run_case(make_case(
      "flip", {{3, 4, 2}},
      [](const Inputs& x) {
        return flip(x[0], {0, -1});
      },
      [](const Inputs& x) {
        auto v = x[0].to_vector<double>();
        std::vector<double> out(v.size());
        const Shape& s = x[0].shape();
        for (int64_t i = 0; i < x[0].numel(); ++i) {
          auto pos = unravel(i, s);
          pos[0] = s[0] - 1 - pos[0];
          pos[2] = s[2] - 1 - pos[2];
          out[i] = v[ravel(pos, s)];
        }
        return from_values(out, s);
      },
      {}, {{0, 4, 2}}));
  run_case(make_case(
      "repeat", {{2, 3}},
      [](const Inputs& x) {
        return repeat(x[0], {2, 1, 3});
      },
      [](const Inputs& x) {
        auto v = x[0].to_vector<double>();
        const Shape& s = x[0].shape();
        const Shape out_shape{2, s[0], 3 * s[1]};
        std::vector<double> out(static_cast<size_t>(numel_of(out_shape)));
        for (int64_t i = 0; i < numel_of(out_shape); ++i) {
          auto pos = unravel(i, out_shape);
          out[i] = v[pos[1] * s[1] + pos[2] % s[1]];
        }
        return from_values(out, out_shape);
      },
      {}, {{0, 3}}));
  run_case(make_case(
      "pad_mixed_signs", {{3, 4}},
      [](const Inputs& x) {
        return pad(x[0], {1, 2, -1, 3}, 0.5);
      },
      [](const Inputs& x) {
        auto v = x[0].to_vector<double>();
        const Shape& s = x[0].shape();
        const Shape out_shape{s[0] + 2, s[1] + 3};
        std::vector<double> out(static_cast<size_t>(numel_of(out_shape)), 0.5);
        for (int64_t i = 0; i < numel_of(out_shape); ++i) {
          auto pos = unravel(i, out_shape);
          const int64_t r = pos[0] + 1, c = pos[1] - 1;  // dim 0 cropped by 1, dim 1 padded by 1
          if (r >= 0 && r < s[0] && c >= 0 && c < s[1]) out[i] = v[r * s[1] + c];
        }
        return from_values(out, out_shape);
      },
      {}, {{0, 4}}));
}

// ---------------------------------------------------------------- direct tests

TEST_CASE("duplicate indices accumulate in every backward") {
  Tensor x = f64({1, 2, 3, 4, 5, 6}, {3, 2}).requires_grad_();
  Tensor idx = i64({0, 0, 2, 0});

  SUBCASE("index_select") {
    sum(index_select(x, 0, idx)).backward();
    CHECK(x.grad().to_vector<double>() == std::vector<double>{3, 3, 0, 0, 1, 1});
  }
  SUBCASE("gather") {
    Tensor gi = i64({1, 1, 0, 1, 1, 1}, {3, 2});
    sum(gather(x, 1, gi)).backward();
    CHECK(x.grad().to_vector<double>() == std::vector<double>{0, 2, 1, 1, 0, 2});
  }
  SUBCASE("embedding") {
    Tensor out = embedding(x, i64({2, 2, 2, 1}, {2, 2}));
    CHECK(out.shape() == Shape{2, 2, 2});
    CHECK(out.to_vector<double>() == std::vector<double>{5, 6, 5, 6, 5, 6, 3, 4});
    sum(out).backward();
    CHECK(x.grad().to_vector<double>() == std::vector<double>{0, 0, 1, 1, 3, 3});
  }
  SUBCASE("index_add and scatter_add forward and backward") {
    Tensor src = f64({10, 20, 30, 40, 50, 60, 70, 80}, {4, 2}).requires_grad_();
    Tensor y = index_add(zeros({3, 2}, {.dtype = DType::f64}), 0, idx, src);
    CHECK(y.to_vector<double>() == std::vector<double>{110, 140, 0, 0, 50, 60});
    sum(y * f64({1, 2, 3, 4, 5, 6}, {3, 2})).backward();
    CHECK(src.grad().to_vector<double>() == std::vector<double>{1, 2, 1, 2, 5, 6, 1, 2});

    Tensor s2 = f64({1, 2, 3, 4}).requires_grad_();
    Tensor z = scatter_add(zeros({3}, {.dtype = DType::f64}), 0, i64({1, 1, 1, 0}), s2);
    CHECK(z.to_vector<double>() == std::vector<double>{4, 6, 0});
    sum(z * f64({10, 20, 30})).backward();
    CHECK(s2.grad().to_vector<double>() == std::vector<double>{20, 20, 20, 10});
  }
  SUBCASE("scatter_add writes an x handed over in place, and copies one still held") {
    const Tensor src = f64({1, 2, 3, 4});
    const Tensor held = f64({5, 5, 5});
    const Tensor copied = scatter_add(held, 0, i64({1, 1, 1, 0}), src);
    CHECK(copied.raw_data() != held.raw_data());
    CHECK(held.to_vector<double>() == std::vector<double>{5, 5, 5});
    CHECK(copied.to_vector<double>() == std::vector<double>{9, 11, 5});
    Tensor handed = f64({5, 5, 5});
    const void* at = handed.raw_data();
    const Tensor in_place = scatter_add(std::move(handed), 0, i64({1, 1, 1, 0}), src);
    CHECK(in_place.raw_data() == at);
    CHECK(in_place.to_vector<double>() == std::vector<double>{9, 11, 5});
    // In the graph: x made by an op (which keeps nothing of it) still passes
    // the gradient to that op's input.
    const Tensor a = f64({1, 2, 3}).requires_grad_();
    Tensor x = a * 2.0;
    const void* xat = x.raw_data();
    const Tensor y = scatter_add(std::move(x), 0, i64({0}), f64({7}));
    CHECK(y.raw_data() == xat);
    CHECK(y.to_vector<double>() == std::vector<double>{9, 4, 6});
    sum(y * f64({1, 10, 100})).backward();
    CHECK(a.grad().to_vector<double>() == std::vector<double>{2, 20, 200});
  }
  SUBCASE("scatter: the last write wins and x gets no gradient where written") {
    Tensor base = f64({1, 2, 3}).requires_grad_();
    Tensor src = f64({7, 8, 9}).requires_grad_();
    Tensor y = scatter(base, 0, i64({2, 2, 0}), src);
    CHECK(y.to_vector<double>() == std::vector<double>{9, 2, 8});
    sum(y * f64({1, 10, 100})).backward();
    CHECK(base.grad().to_vector<double>() == std::vector<double>{0, 10, 0});
    CHECK(src.grad().to_vector<double>() == std::vector<double>{100, 100, 1});
  }
}

TEST_CASE("out-of-range indices fail before any kernel, naming op, index and size") {
  Tensor x = f64({1, 2, 3, 4, 5, 6}, {3, 2});
  CHECK_THROWS_WITH_AS(index_select(x, 0, i64({0, 3})),
                       "[index_select] index 3 is out of bounds for dim 0 with size 3",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(index_select(x, 1, i64({-1})),
                       "[index_select] index -1 is out of bounds for dim 1 with size 2",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(gather(x, 1, i64({0, 2, 0, 0, 1, 1}, {3, 2})),
                       "[gather] index 2 is out of bounds for dim 1 with size 2",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(scatter(x, 0, i64({5, 0}, {1, 2}), f64({1, 1}, {1, 2})),
                       "[scatter] index 5 is out of bounds for dim 0 with size 3",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(scatter(x, 0, i64({0, 7}, {1, 2}), 1.0),
                       "[scatter] index 7 is out of bounds for dim 0 with size 3",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(scatter_add(x, -1, i64({0, 9}, {1, 2}), f64({1, 1}, {1, 2})),
                       "[scatter_add] index 9 is out of bounds for dim 1 with size 2",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(index_add(x, 0, i64({3}), f64({1, 1}, {1, 2})),
                       "[index_add] index 3 is out of bounds for dim 0 with size 3",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(embedding(x, i64({0, 4})),
                       "[embedding] index 4 is out of bounds for dim 0 with size 3",
                       std::invalid_argument);
  // x is untouched by a failed call (ops are out of place anyway).
  CHECK(x.to_vector<double>() == std::vector<double>{1, 2, 3, 4, 5, 6});
}

TEST_CASE("index dtypes, shapes and argument errors") {
  Tensor x = f64({1, 2, 3, 4, 5, 6}, {3, 2});
  // i32 indices are accepted.
  Tensor i32 = from_vector<int32_t>({2, 0});
  CHECK(index_select(x, 0, i32).to_vector<double>() == std::vector<double>{5, 6, 1, 2});
  CHECK(embedding(x, i32).shape() == Shape{2, 2});
  CHECK_THROWS_WITH_AS(index_select(x, 0, f64({0})),
                       "[index_select] index must be i64 or i32, got f64", std::invalid_argument);
  CHECK_THROWS_WITH_AS(gather(x, 0, i64({0, 0, 0})),
                       doctest::Contains("[gather] index has 1 dims, expected 2"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(gather(x, 0, i64({0, 0, 0}, {1, 3})),
                       doctest::Contains("[gather] index of shape [1, 3] exceeds"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(scatter(x, 0, i64({0, 0}, {1, 2}), from_vector<float>({1, 2}, {1, 2})),
                       doctest::Contains("[scatter] src has dtype f32"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(index_add(x, 0, i64({0}), f64({1, 2, 3}, {1, 3})),
                       doctest::Contains("[index_add] src has shape [1, 3], expected [1, 2]"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(masked_fill(x, from_vector<uint8_t>({1, 0}), 0.0),
                       "[masked_fill] mask must be bool, got u8", std::invalid_argument);
  CHECK_THROWS_WITH_AS(embedding(x, i64({0}), 3),
                       doctest::Contains("[embedding] padding_idx 3 is out of range"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(index_select(x, 2, i64({0})), doctest::Contains("[index_select] dim 2"),
                       std::invalid_argument);
  // 0-d index keeps the dim (size 1), like PyTorch.
  CHECK(index_select(x, 1, i64({1}, {1}).reshape({})).shape() == Shape{3, 1});
  // Integer and bool data move too.
  Tensor xi = from_vector<int64_t>({10, 20, 30});
  CHECK(gather(xi, 0, i64({2, 2, 0})).to_vector<int64_t>() == std::vector<int64_t>{30, 30, 10});
  CHECK(scatter_add(xi, 0, i64({1, 1}), from_vector<int64_t>({5, 6})).to_vector<int64_t>() ==
        std::vector<int64_t>{10, 31, 30});
  Tensor xb = from_vector<bool>({true, false});
  CHECK(index_select(xb, 0, i64({1, 0, 1})).to_vector<bool>() ==
        std::vector<bool>{false, true, false});
  // 16-bit floats accumulate in f32 and are stored back.
  Tensor h = from_vector<float>({1, 2}).to(DType::bf16);
  Tensor ha = index_add(h, 0, i64({0, 0}), from_vector<float>({0.5f, 0.25f}).to(DType::bf16));
  CHECK(ha.dtype() == DType::bf16);
  CHECK(ha.to_vector<float>() == std::vector<float>{1.75f, 2.0f});
}

TEST_CASE("scatter/gather accept non-contiguous views directly") {
  Tensor base = f64({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor xt = base.t();  // [3, 2], non-contiguous
  Tensor idx = i64({1, 0, 0, 0, 1, 1}, {3, 2});
  CHECK(gather(xt, 1, idx).to_vector<double>() == std::vector<double>{4, 1, 2, 2, 6, 6});
  Tensor src = f64({10, 20, 30, 40, 50, 60, 70, 80}, {2, 4}).slice(1, 0, 4, 2);  // [2, 2]
  Tensor y = scatter(zeros({2, 3}, {.dtype = DType::f64}), 1, i64({2, 0, 1, 2}, {2, 2}), src);
  CHECK(y.to_vector<double>() == std::vector<double>{30, 0, 10, 0, 50, 70});
}

TEST_CASE("masked_fill and masked_select values, order and gradient") {
  Tensor x = f64({1, 2, 3, 4, 5, 6}, {2, 3}).requires_grad_();
  Tensor m = from_vector<bool>({true, false, true});  // broadcasts over rows
  Tensor f = masked_fill(x, m, -9);
  CHECK(f.to_vector<double>() == std::vector<double>{-9, 2, -9, -9, 5, -9});
  Tensor s = masked_select(x, m);
  CHECK(s.shape() == Shape{4});
  CHECK(s.to_vector<double>() == std::vector<double>{1, 3, 4, 6});  // row-major order
  sum(s * f64({1, 2, 3, 4})).backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{1, 0, 2, 3, 0, 4});
  // x broadcasting against a larger mask: the gradient sums over the copies.
  Tensor v = f64({1, 2}).requires_grad_();
  Tensor mm = from_vector<bool>({true, true, false, true}, {2, 2});
  Tensor sv = masked_select(v, mm);
  CHECK(sv.to_vector<double>() == std::vector<double>{1, 2, 2});
  sum(sv).backward();
  CHECK(v.grad().to_vector<double>() == std::vector<double>{1, 2});
  CHECK(masked_select(x, zeros({3}, {.dtype = DType::boolean})).shape() == Shape{0});
  // Integer x keeps its dtype; the value is cast.
  CHECK(masked_fill(from_vector<int64_t>({1, 2}), from_vector<bool>({false, true}), 7)
            .to_vector<int64_t>() == std::vector<int64_t>{1, 7});
}

TEST_CASE("embedding padding_idx gets no gradient") {
  Tensor w = f64({1, 2, 3, 4, 5, 6, 7, 8}, {4, 2}).requires_grad_();
  Tensor ids = i64({1, 3, 1, 0, 3, 3}, {3, 2});
  Tensor out = embedding(w, ids, 3);
  CHECK(out.shape() == Shape{3, 2, 2});
  // The padding row is still looked up (only its gradient is dropped).
  CHECK(out.to_vector<double>() == std::vector<double>{3, 4, 7, 8, 3, 4, 1, 2, 7, 8, 7, 8});
  sum(out).backward();
  CHECK(w.grad().to_vector<double>() == std::vector<double>{1, 1, 2, 2, 0, 0, 0, 0});
  // Without padding_idx row 3 collects three lookups.
  Tensor w2 = w.detach().clone().requires_grad_();
  sum(embedding(w2, ids)).backward();
  CHECK(w2.grad().to_vector<double>() == std::vector<double>{1, 1, 2, 2, 0, 0, 3, 3});
  // Empty indices give an empty result and a zero gradient.
  Tensor w3 = w.detach().clone().requires_grad_();
  Tensor e = embedding(w3, i64({}, {0, 5}));
  CHECK(e.shape() == Shape{0, 5, 2});
  (sum(e) + sum(w3) * 0.0).backward();
  CHECK(w3.grad().to_vector<double>() == std::vector<double>(8, 0.0));
}

TEST_CASE("split and chunk sizes follow PyTorch") {
  Tensor x = arange(0, 10, 1, {.dtype = DType::f64});
  CHECK(sizes_along(split(x, 3), 0) == std::vector<int64_t>{3, 3, 3, 1});
  CHECK(sizes_along(split(x, 10), 0) == std::vector<int64_t>{10});
  CHECK(sizes_along(split(x, 20), 0) == std::vector<int64_t>{10});
  CHECK(sizes_along(split(x, std::vector<int64_t>{2, 0, 8}), 0) == std::vector<int64_t>{2, 0, 8});
  CHECK(split(x, 3)[3].to_vector<double>() == std::vector<double>{9});
  CHECK(sizes_along(split(zeros({0, 2}), 2), 0) == std::vector<int64_t>{0});
  CHECK(sizes_along(chunk(x, 3), 0) == std::vector<int64_t>{4, 4, 2});
  CHECK(sizes_along(chunk(x, 4), 0) == std::vector<int64_t>{3, 3, 3, 1});
  CHECK(sizes_along(chunk(arange(0, 5, 1), 4), 0) == std::vector<int64_t>{2, 2, 1});
  CHECK(sizes_along(chunk(arange(0, 6, 1), 4), 0) == std::vector<int64_t>{2, 2, 2});
  CHECK(sizes_along(chunk(x, 20), 0) == std::vector<int64_t>(10, 1));
  CHECK(sizes_along(chunk(zeros({2, 0}), 3, -1), 1) == std::vector<int64_t>{0, 0, 0});
  // Pieces are views: they see later writes to x.
  auto pieces = split(x, 4);
  {
    NoGradGuard no_grad;
    fill_(x.narrow(0, 5, 1), 100);
  }
  CHECK(pieces[1].to_vector<double>() == std::vector<double>{4, 100, 6, 7});
  CHECK(pieces[1].storage() == x.storage());
  CHECK_THROWS_WITH_AS(split(x, std::vector<int64_t>{3, 3}),
                       "[split] split sizes sum to 6, expected 10 (the size of dim 0)",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(split(x, 0), doctest::Contains("[split] split_size must be positive"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(chunk(x, 0), "[chunk] chunks must be positive, got 0",
                       std::invalid_argument);
  // Only some pieces used: the others contribute zeros.
  Tensor y = arange(0, 6, 1, {.dtype = DType::f64}).requires_grad_();
  auto parts = chunk(y, 3);
  sum(parts[2] * 2.0).backward();
  CHECK(y.grad().to_vector<double>() == std::vector<double>{0, 0, 0, 0, 2, 2});
}

TEST_CASE("pad with negative values crops; pad's backward is the inverse crop") {
  Tensor x = f64({1, 2, 3, 4, 5, 6}, {2, 3}).requires_grad_();
  Tensor y = pad(x, {-1, 2}, 9);  // last dim: crop one in front, two after
  CHECK(y.shape() == Shape{2, 4});
  CHECK(y.to_vector<double>() == std::vector<double>{2, 3, 9, 9, 5, 6, 9, 9});
  sum(y * f64({1, 2, 3, 4, 5, 6, 7, 8}, {2, 4})).backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{0, 1, 2, 0, 5, 6});
  Tensor z = pad(x.detach(), {0, 0, 1, -2});  // dim 0: one row on top, crop two below
  CHECK(z.shape() == Shape{1, 3});
  CHECK(z.to_vector<double>() == std::vector<double>{0, 0, 0});
  Tensor w = pad(x.detach(), {-3, 1});  // crops everything, then one pad column
  CHECK(w.shape() == Shape{2, 1});
  CHECK(w.to_vector<double>() == std::vector<double>{0, 0});
  Tensor i = pad(from_vector<int64_t>({1, 2}), {1, 1}, 7);
  CHECK(i.dtype() == DType::i64);
  CHECK(i.to_vector<int64_t>() == std::vector<int64_t>{7, 1, 2, 7});
  CHECK_THROWS_WITH_AS(pad(x, {1, 2, 3}), doctest::Contains("[pad] got 3 pad values"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(pad(x, {-2, -2}), doctest::Contains("would have negative size -1"),
                       std::invalid_argument);
}

TEST_CASE("cat of zero-size pieces, dtype promotion and errors") {
  Tensor a = f64({1, 2, 3, 4}, {2, 2}), e = zeros({0, 2}, {.dtype = DType::f64});
  Tensor c = cat({e, a, e}, 0);
  CHECK(c.shape() == Shape{2, 2});
  CHECK(c.to_vector<double>() == std::vector<double>{1, 2, 3, 4});
  CHECK(cat({e, e}, 0).shape() == Shape{0, 2});
  CHECK(cat({zeros({0, 2}), zeros({0, 3})}, 1).shape() == Shape{0, 5});
  Tensor mixed = cat({from_vector<int32_t>({1, 2}), from_vector<float>({0.5f})}, 0);
  CHECK(mixed.dtype() == DType::f32);
  CHECK(mixed.to_vector<float>() == std::vector<float>{1, 2, 0.5f});
  CHECK(cat({from_vector<int32_t>({1}), from_vector<int64_t>({2})}).dtype() == DType::i64);
  // Pieces of every kind in one cat, on every device: contiguous ones of the
  // output's dtype (copied together), a transposed view, another dtype and
  // an empty piece, along a middle dim (rows of each piece strided apart).
  for (const Device dev : testing::cpu_and_test_devices()) {
    INFO(dev.str());
    Generator gen(3);
    const Tensor x = randn({2, 3, 4}, gen).to(dev), y = randn({2, 4, 3}, gen).to(dev);
    const Tensor z = randn({2, 1, 4}, gen, {.dtype = DType::f64}).to(DType::f32).to(dev);
    const Tensor w = randn({2, 2, 4}, gen).to(DType::bf16).to(dev);
    const Tensor got = cat({x, transpose(y, 1, 2), zeros({2, 0, 4}, {.device = dev}), z, w, x}, 1);
    REQUIRE(got.shape() == Shape{2, 12, 4});
    const std::vector<Tensor> pieces = {x, transpose(y, 1, 2).contiguous(), z, w.to(DType::f32), x};
    int64_t at = 0;
    for (const Tensor& piece : pieces) {
      CHECK(
          slice(got, 1, at, at + piece.size(1)).to(Device::cpu()).contiguous().to_vector<float>() ==
          piece.to(Device::cpu()).contiguous().to_vector<float>());
      at += piece.size(1);
    }
  }
  // Gradients reach floating pieces only, in their own dtype.
  Tensor p = from_vector<float>({1, 2}).requires_grad_();
  Tensor q = from_vector<double>({3}).requires_grad_();
  Tensor r = cat({p, from_vector<int64_t>({5}), q});
  CHECK(r.dtype() == DType::f64);
  sum(r * f64({1, 2, 3, 4})).backward();
  CHECK(p.grad().dtype() == DType::f32);
  CHECK(p.grad().to_vector<float>() == std::vector<float>{1, 2});
  CHECK(q.grad().to_vector<double>() == std::vector<double>{4});
  CHECK_THROWS_WITH_AS(cat({a, zeros({2, 3}, {.dtype = DType::f64})}, 0),
                       doctest::Contains("[cat] tensor 1 has shape [2, 3], expected [2, 2]"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(cat({}, 0), doctest::Contains("[cat] needs at least one tensor"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(cat({scalar(1.0)}, 0), doctest::Contains("[cat] tensor 0 is 0-d"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(stack({a, zeros({2, 3})}, 0),
                       doctest::Contains("[stack] tensor 1 has shape [2, 3]"),
                       std::invalid_argument);
  Tensor s = stack({scalar(1.0), scalar(2.0)}, 0);
  CHECK(s.shape() == Shape{2});
}

TEST_CASE("flip and repeat values and backward") {
  Tensor x = f64({1, 2, 3, 4, 5, 6}, {2, 3}).requires_grad_();
  CHECK(flip(x, {1}).to_vector<double>() == std::vector<double>{3, 2, 1, 6, 5, 4});
  CHECK(flip(x, {}).to_vector<double>() == std::vector<double>{1, 2, 3, 4, 5, 6});
  CHECK(flip(x.t(), {0, 1}).to_vector<double>() == std::vector<double>{6, 3, 5, 2, 4, 1});
  CHECK_THROWS_WITH_AS(flip(x, {1, -1}), "[flip] dim 1 appears more than once",
                       std::invalid_argument);
  Tensor r = repeat(x, {2, 2});
  CHECK(r.shape() == Shape{4, 6});
  CHECK(r.to_vector<double>()[0 * 6 + 3] == 1);
  CHECK(r.to_vector<double>()[3 * 6 + 5] == 6);
  sum(r).backward();  // every element was tiled 4 times
  CHECK(x.grad().to_vector<double>() == std::vector<double>(6, 4.0));
  CHECK(repeat(x.detach(), {0, 1}).shape() == Shape{0, 3});
  Tensor same = repeat(x.detach(), {1, 1});
  CHECK_FALSE(same.storage() == x.storage());  // always a copy, like torch
  CHECK_THROWS_WITH_AS(repeat(x, {2}), doctest::Contains("[repeat] got 1 repeats"),
                       std::invalid_argument);
}

TEST_CASE("large inputs (parallel kernel paths) match the references") {
  // Big enough that index_select, gather, scatter_add and both index_add
  // splits run across threads; duplicates everywhere.
  uint64_t st = 42;
  auto rand_idx = [&](const Shape& s, int64_t bound) {
    std::vector<int64_t> v(static_cast<size_t>(numel_of(s)));
    for (auto& x : v) x = static_cast<int64_t>(next_rand(st) % bound);
    return i64(v, {static_cast<int64_t>(v.size())}).reshape(s);
  };
  auto close = [](const Tensor& a, const Tensor& b) {
    auto va = a.to_vector<double>(), vb = b.to_vector<double>();
    double worst = 0;
    for (size_t i = 0; i < va.size(); ++i) worst = std::max(worst, std::abs(va[i] - vb[i]));
    return a.shape() == b.shape() && worst < 1e-9;
  };
  Tensor x = make_input({300, 200}, Domain::any, 1);
  Tensor idx = rand_idx({500}, 300);
  CHECK(close(index_select(x, 0, idx), ref_index_select(x, 0, idx)));
  Tensor gi = rand_idx({300, 400}, 200);
  CHECK(close(gather(x, 1, gi), ref_gather(x, 1, gi)));
  Tensor si = rand_idx({600, 200}, 300);
  Tensor src = make_input({600, 200}, Domain::any, 2);
  CHECK(close(scatter_add(x, 0, si, src), ref_scatter(x, 0, si, src, 1)));
  // index_add split over columns (outer = 1) and over rows (outer > inner).
  Tensor src_cols = make_input({500, 200}, Domain::any, 3);
  CHECK(close(index_add(x, 0, idx, src_cols, 0.5), ref_index_add(x, 0, idx, src_cols, 0.5)));
  Tensor ci = rand_idx({400}, 200);
  Tensor src_rows = make_input({300, 400}, Domain::any, 4);
  CHECK(close(index_add(x, 1, ci, src_rows), ref_index_add(x, 1, ci, src_rows, 1.0)));
  // Gradient of embedding with many duplicates equals the index counts.
  Tensor w = zeros({50, 8}, {.dtype = DType::f64}).requires_grad_();
  Tensor ids = rand_idx({4000}, 50);
  sum(embedding(w, ids)).backward();
  auto counts = std::vector<double>(50, 0.0);
  for (int64_t v : ids.to_vector<int64_t>()) counts[v] += 1;
  auto g = w.grad().to_vector<double>();
  bool ok = true;
  for (int64_t r = 0; r < 50; ++r)
    for (int64_t c = 0; c < 8; ++c) ok = ok && g[r * 8 + c] == counts[r];
  CHECK(ok);
}

TEST_CASE("index_add with long runs of repeated indices: the CPU's bits on every test device") {
  // 5000 positions into 37 rows (every row hit about 135 times, row 3 by a
  // run of 400 in a row), along the middle dim of [3, 37, 19]: the CUDA
  // kernel sorts the positions and adds each index's run in order, which
  // must be the order of adding them one by one.
  Generator gen(9);
  std::vector<int64_t> idx(5000);
  for (size_t j = 0; j < idx.size(); ++j)
    idx[j] = j >= 1000 && j < 1400 ? 3 : static_cast<int64_t>((j * 7919 + j / 13) % 37);
  const Tensor index = from_vector<int64_t>(idx, {5000});
  for (DType t : {DType::f32, DType::f64}) {
    CAPTURE(dtype_name(t));
    const Tensor x = randn({3, 37, 19}, gen, {.dtype = t});
    const Tensor src = randn({3, 5000, 19}, gen, {.dtype = t});
    const std::vector<double> want = index_add(x, 1, index, src, 0.7).to_vector<double>();
    for (const Device dev : test_devices()) {
      CAPTURE(dev.str());
      const std::vector<double> got = index_add(x.to(dev), 1, index.to(dev), src.to(dev), 0.7)
                                          .to(Device::cpu())
                                          .to_vector<double>();
      REQUIRE(got.size() == want.size());
      size_t differ = 0;
      for (size_t i = 0; i < got.size(); ++i) differ += got[i] != want[i];
      CHECK(differ == 0);
    }
  }
}
