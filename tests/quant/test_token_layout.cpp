// TokenLayout: every input layout a quantizer accepts, to tokens and back.
#include <doctest/doctest.h>

#include <vector>

#include "quanta.h"

using namespace quanta;
using quant::TokenLayout;

namespace {
Tensor iota(const Shape& s) {
  return reshape(arange(0, double(numel_of(s)), 1, {.dtype = DType::f32}), s);
}
std::vector<float> vals(const Tensor& t) {
  const Tensor c = contiguous(t);
  return std::vector<float>(c.data<float>(), c.data<float>() + c.numel());
}
bool same(const Tensor& a, const Tensor& b) { return a.shape() == b.shape() && vals(a) == vals(b); }
// The element of `t` at `idx` (any layout).
float at(const Tensor& t, const std::vector<int64_t>& idx) {
  Tensor v = t;
  for (int64_t i : idx) v = select(v, 0, i);
  return float(v.item());
}
}  // namespace

TEST_CASE("channel-last sequences and single vectors") {
  const Tensor x = iota({2, 3, 4});
  const TokenLayout l(x, true, 4, "test");
  CHECK(l.batch() == 2);
  CHECK(l.tokens() == 3);
  CHECK(l.spatial() == Shape{3});
  CHECK(same(l.to_tokens(x), x));
  CHECK(same(l.from_tokens(l.to_tokens(x)), x));
  CHECK(l.spatial_from_tokens(zeros({2, 3, 5})).shape() == Shape{2, 3, 5});

  const Tensor v = iota({2, 4});
  const TokenLayout s(v, true, 4, "test");
  CHECK(s.to_tokens(v).shape() == Shape{2, 1, 4});
  CHECK(same(s.from_tokens(s.to_tokens(v)), v));
  CHECK(s.spatial_from_tokens(zeros({2, 1}, {.dtype = DType::i64})).shape() == Shape{2});
}

TEST_CASE("channel-first sequences and image feature maps") {
  const Tensor x = iota({2, 4, 3});  // [B, D, N]
  const TokenLayout l(x, false, 4, "test");
  const Tensor t = l.to_tokens(x);
  CHECK(t.shape() == Shape{2, 3, 4});
  CHECK(at(t, {0, 1, 2}) == at(x, {0, 2, 1}));
  CHECK(same(l.from_tokens(t), x));

  const Tensor img = iota({2, 4, 3, 5});  // [B, C, H, W] whatever channel_last says
  const TokenLayout m(img, true, 4, "test");
  CHECK(m.spatial() == Shape{3, 5});
  const Tensor ti = m.to_tokens(img);
  CHECK(ti.shape() == Shape{2, 15, 4});
  CHECK(at(ti, {1, 7, 3}) == at(img, {1, 3, 1, 2}));
  CHECK(same(m.from_tokens(ti), img));
  CHECK(m.from_tokens(zeros({2, 15, 6})).shape() == Shape{2, 6, 3, 5});
  const Tensor idx = zeros({2, 15, 2}, {.dtype = DType::i64});
  const Tensor sp = m.spatial_from_tokens(idx);
  CHECK(sp.shape() == Shape{2, 3, 5, 2});
  CHECK(m.spatial_to_tokens(sp, 1).shape() == Shape{2, 15, 2});
}

TEST_CASE("zero-size batches and bad inputs") {
  const TokenLayout l(zeros({0, 5, 4}), true, 4, "test");
  CHECK(l.to_tokens(zeros({0, 5, 4})).shape() == Shape{0, 5, 4});
  CHECK_THROWS_WITH_AS(TokenLayout(zeros({4}), true, 4, "VectorQuantize"),
                       doctest::Contains("[VectorQuantize]"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(TokenLayout(zeros({2, 3, 5}), true, 4, "FSQ"),
                       doctest::Contains("expects 4 features"), std::invalid_argument);
}
