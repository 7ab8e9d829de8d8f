// Op-harness rows for matrix products (matmul in every rank combination,
// linear, bmm, outer, sq_dist) against plain-loop references, plus sizes that
// reach Eigen's blocked GEMM, 16-bit dtypes and error messages.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "engine/ops/harness.h"
#include "support/gpu.h"

using namespace quanta;
using namespace quanta::testing;

namespace {

Tensor from_values(const std::vector<double>& v, const Shape& shape) {
  const int64_t n = static_cast<int64_t>(v.size());
  return from_vector<double>(v, n ? Shape{n} : Shape{0}).reshape(shape);
}

// NumPy matmul with plain loops: 1-d operands promoted, batch dims broadcast.
Tensor ref_matmul(const Tensor& a, const Tensor& b) {
  Shape as = a.shape(), bs = b.shape();
  const bool a1 = as.size() == 1, b1 = bs.size() == 1;
  if (a1) as.insert(as.begin(), 1);
  if (b1) bs.push_back(1);
  const int64_t m = as[as.size() - 2], k = as.back(), n = bs.back();
  const Shape ab(as.begin(), as.end() - 2), bb(bs.begin(), bs.end() - 2);
  const Shape batch = broadcast_shapes(ab, bb, "ref_matmul");
  const auto av = a.to_vector<double>(), bv = b.to_vector<double>();
  const int64_t nb = numel_of(batch);
  std::vector<double> out(static_cast<size_t>(nb * m * n), 0.0);
  auto sub_index = [&](const std::vector<int64_t>& idx, const Shape& s) {
    std::vector<int64_t> sub(s.size());
    for (size_t d = 0; d < s.size(); ++d) sub[d] = s[d] == 1 ? 0 : idx[d + batch.size() - s.size()];
    return ravel(sub, s);
  };
  for (int64_t t = 0; t < nb; ++t) {
    const auto idx = unravel(t, batch);
    const int64_t ao = sub_index(idx, ab) * m * k, bo = sub_index(idx, bb) * k * n;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t p = 0; p < k; ++p) s += av[ao + i * k + p] * bv[bo + p * n + j];
        out[(t * m + i) * n + j] = s;
      }
  }
  Shape os = batch;
  if (!a1) os.push_back(m);
  if (!b1) os.push_back(n);
  return from_values(out, os);
}

// Swaps the last two dims with plain loops.
Tensor ref_t(const Tensor& x) {
  const Shape& s = x.shape();
  const int64_t r = s[s.size() - 2], c = s.back(), nb = x.numel() / std::max<int64_t>(r * c, 1);
  const auto v = x.to_vector<double>();
  std::vector<double> out(v.size());
  for (int64_t t = 0; t < nb; ++t)
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < c; ++j) out[(t * c + j) * r + i] = v[(t * r + i) * c + j];
  Shape os = s;
  std::swap(os[os.size() - 2], os[os.size() - 1]);
  return from_values(out, os);
}

OpCase matmul_case(std::string name, std::vector<Shape> shapes, std::vector<Shape> bcast = {},
                   std::vector<Shape> zero = {}) {
  OpCase c;
  c.name = std::move(name);
  c.shapes = std::move(shapes);
  c.broadcast_shapes = std::move(bcast);
  c.zero_shapes = std::move(zero);
  c.op = [](const Inputs& x) { return matmul(x[0], x[1]); };
  c.reference = [](const Inputs& x) { return ref_matmul(x[0], x[1]); };
  c.half = true;
  return c;
}

// Reference linear: x [..., in] w [out, in] (+ b).
Tensor ref_linear(const Tensor& x, const Tensor& w, const Tensor* b) {
  Tensor y = ref_matmul(x, ref_t(w));
  if (!b) return y;
  auto yv = y.to_vector<double>();
  const auto bv = b->to_vector<double>();
  const int64_t out = w.size(0);
  for (size_t i = 0; i < yv.size(); ++i) yv[i] += bv[i % out];
  return from_values(yv, y.shape());
}

Tensor ref_sq_dist(const Tensor& x, const Tensor& c) {
  const int64_t N = x.size(0), K = c.size(0), D = x.size(1);
  const auto xv = x.to_vector<double>(), cv = c.to_vector<double>();
  std::vector<double> out(static_cast<size_t>(N * K));
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < K; ++j) {
      double s = 0;
      for (int64_t d = 0; d < D; ++d) {
        const double diff = xv[i * D + d] - cv[j * D + d];
        s += diff * diff;
      }
      out[i * K + j] = s;
    }
  return from_values(out, {N, K});
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const auto av = a.to_vector<double>(), bv = b.to_vector<double>();
  REQUIRE(av.size() == bv.size());
  double worst = 0;
  for (size_t i = 0; i < av.size(); ++i) worst = std::max(worst, std::abs(av[i] - bv[i]));
  return worst;
}

}  // namespace

TEST_CASE("matmul through the harness: every rank combination") {
  run_case(matmul_case("matmul 1d.1d", {{5}, {5}}, {}, {{0}, {0}}));
  run_case(matmul_case("matmul 1d.2d", {{4}, {4, 3}}, {{4}, {2, 4, 3}}, {{0}, {0, 3}}));
  run_case(matmul_case("matmul 2d.1d", {{3, 4}, {4}}, {{2, 3, 4}, {4}}, {{0, 4}, {4}}));
  run_case(matmul_case("matmul 2d.2d", {{3, 4}, {4, 5}}, {}, {{0, 4}, {4, 5}}));
  run_case(matmul_case("matmul 2d.2d empty inner dim", {{3, 2}, {2, 5}}, {}, {{3, 0}, {0, 5}}));
  run_case(matmul_case("matmul blocked-GEMM sizes", {{17, 23}, {23, 19}}));
  run_case(matmul_case("matmul batched", {{2, 3, 4}, {2, 4, 5}}, {{2, 1, 3, 4}, {3, 4, 5}},
                       {{0, 3, 4}, {0, 4, 5}}));
  run_case(matmul_case("matmul batch times matrix", {{2, 3, 4}, {4, 5}}, {{3, 4}, {2, 4, 5}},
                       {{0, 3, 4}, {4, 5}}));
  run_case(matmul_case("matmul broadcast batch dims", {{2, 1, 3, 4}, {1, 3, 4, 2}},
                       {{1, 2, 3}, {4, 1, 3, 2}}, {{2, 0, 3, 4}, {1, 4, 2}}));
}

TEST_CASE("matmul through the harness: transposed operands") {
  OpCase at = matmul_case("matmul a^T b", {{4, 3}, {4, 5}});
  at.op = [](const Inputs& x) { return matmul(x[0].t(), x[1]); };
  at.reference = [](const Inputs& x) { return ref_matmul(ref_t(x[0]), x[1]); };
  run_case(at);

  OpCase bt = matmul_case("matmul a b^T", {{3, 4}, {5, 4}});
  bt.op = [](const Inputs& x) { return matmul(x[0], x[1].t()); };
  bt.reference = [](const Inputs& x) { return ref_matmul(x[0], ref_t(x[1])); };
  run_case(bt);

  OpCase both = matmul_case("matmul batched a^T b^T", {{2, 4, 3}, {2, 5, 4}}, {{4, 3}, {2, 5, 4}});
  both.op = [](const Inputs& x) {
    return matmul(transpose(x[0], -1, -2), transpose(x[1], -1, -2));
  };
  both.reference = [](const Inputs& x) { return ref_matmul(ref_t(x[0]), ref_t(x[1])); };
  run_case(both);

  // A permuted batch: the rows of `a` cannot merge across the batch.
  OpCase perm = matmul_case("matmul permuted batch times matrix", {{3, 2, 4}, {4, 5}});
  perm.op = [](const Inputs& x) { return matmul(permute(x[0], {1, 0, 2}), x[1]); };
  perm.reference = [](const Inputs& x) {
    const Tensor a = permute(x[0], {1, 0, 2}).contiguous();
    return ref_matmul(a, x[1]);
  };
  run_case(perm);
}

TEST_CASE("linear, bmm, outer and sq_dist through the harness") {
  OpCase lb;
  lb.name = "linear with bias";
  lb.shapes = {{2, 3, 4}, {5, 4}, {5}};
  lb.broadcast_shapes = {{4}, {5, 4}, {5}};  // a 1-d input
  lb.zero_shapes = {{0, 4}, {5, 4}, {5}};
  lb.op = [](const Inputs& x) { return linear(x[0], x[1], x[2]); };
  lb.reference = [](const Inputs& x) { return ref_linear(x[0], x[1], &x[2]); };
  lb.half = true;
  run_case(lb);

  OpCase ln;
  ln.name = "linear without bias";
  ln.shapes = {{3, 4}, {5, 4}};
  ln.broadcast_shapes = {{2, 2, 4}, {3, 4}};
  ln.zero_shapes = {{3, 0}, {5, 0}};
  ln.op = [](const Inputs& x) { return linear(x[0], x[1]); };
  ln.reference = [](const Inputs& x) { return ref_linear(x[0], x[1], nullptr); };
  ln.half = true;
  run_case(ln);

  // In 3, out 13: the weight gradient is formed as (x^T g)^T, the faster
  // order for LoRA's B (linalg.cpp, weight_grad).
  OpCase lr;
  lr.name = "linear with a low-rank input side";
  lr.shapes = {{2, 3, 3}, {13, 3}};
  lr.zero_shapes = {{0, 3}, {13, 3}};
  lr.op = [](const Inputs& x) { return linear(x[0], x[1]); };
  lr.reference = [](const Inputs& x) { return ref_linear(x[0], x[1], nullptr); };
  lr.half = true;
  run_case(lr);

  // linear_add: c + x w^T, the GEMM accumulating onto c or a copy (the f64
  // gradient check covers c, x and w; devices and 16-bit dtypes as linear).
  OpCase la;
  la.name = "linear_add";
  la.shapes = {{2, 3, 5}, {2, 3, 4}, {5, 4}};
  la.zero_shapes = {{0, 5}, {0, 4}, {5, 4}};
  la.op = [](const Inputs& x) { return linear_add(x[0], x[1], x[2]); };
  la.reference = [](const Inputs& x) { return x[0] + ref_linear(x[1], x[2], nullptr); };
  la.half = true;
  run_case(la);
  CHECK_THROWS_WITH_AS(linear_add(zeros({3, 4}), zeros({3, 4}), zeros({5, 4})),
                       doctest::Contains("[linear_add] the addend must have the product's shape"),
                       std::invalid_argument);

  // dropout_linear: linear(dropout(x)), the dropped copy never stored (the
  // table's dropout_product). Each call draws from a fresh generator, so
  // every evaluation of the gradient check keeps the same elements; the
  // reference drops with the mask that stream gives. Rows over two blocks of
  // the CPU kernel, k not a multiple of 16 and r over 16 (a partial rank
  // chunk); the zero-size variant takes the two ops.
  OpCase dl;
  dl.name = "dropout_linear";
  dl.shapes = {{2, 40, 37}, {20, 37}};
  dl.zero_shapes = {{0, 5}, {3, 5}};
  dl.op = [](const Inputs& x) {
    Generator g = Generator::named(5, "dropout_linear");
    return dropout_linear(x[0], x[1], 0.3, true, g);
  };
  dl.reference = [](const Inputs& x) {
    Generator g = Generator::named(5, "dropout_linear");
    const Tensor keep = scaled_bernoulli(x[0].shape(), 0.7, 1.0 / 0.7, g, {.dtype = DType::f64});
    return ref_linear(x[0] * keep, x[1], nullptr);
  };
  run_case(dl);
  // With a scale (LoRA's alpha / r), which the mask's kept value carries.
  OpCase dls = dl;
  dls.name = "dropout_linear scaled";
  dls.op = [](const Inputs& x) {
    Generator g = Generator::named(5, "dropout_linear");
    return dropout_linear(x[0], x[1], 0.3, true, g, 2.5);
  };
  dls.reference = [ref = dl.reference](const Inputs& x) { return ref(x) * 2.5; };
  run_case(dls);

  {
    // An addend handed over that nothing else holds becomes the output's
    // storage; one still held elsewhere (a handle, a view) is left as it was.
    Generator gen(12);
    const Tensor x0 = randn({6, 4}, gen), w0 = randn({5, 4}, gen), c0 = randn({6, 5}, gen);
    const Tensor want = c0 + linear(x0, w0);
    const Tensor kept = c0.clone();
    const Tensor same = linear_add(kept, x0, w0);
    CHECK(same.raw_data() != kept.raw_data());
    CHECK(max(abs(kept - c0)).item() == 0);
    CHECK(max(abs(same - want)).item() < 1e-6);
    Tensor handed = c0.clone();
    const void* at = handed.raw_data();
    const Tensor onto = linear_add(std::move(handed), x0, w0);
    CHECK(onto.raw_data() == at);
    CHECK(max(abs(onto - want)).item() < 1e-6);
    Tensor viewed = c0.clone();
    const Tensor view = viewed.narrow(0, 0, 2);
    const Tensor copied = linear_add(std::move(viewed), x0, w0);
    CHECK(max(abs(view - c0.narrow(0, 0, 2))).item() == 0);
    CHECK(max(abs(copied - want)).item() < 1e-6);
    // In the graph: c made by an op (its node keeps nothing of it) is written
    // in place, and its gradient still reaches that op's input.
    const Tensor a = c0.clone().requires_grad_(), xg = x0.clone().requires_grad_();
    Tensor c = a * 2.0;
    const void* cat = c.raw_data();
    const Tensor y = linear_add(std::move(c), xg, w0);
    CHECK(y.raw_data() == cat);
    sum(y * want).backward();
    CHECK(max(abs(a.grad() - want * 2.0)).item() < 1e-5);
    CHECK(max(abs(xg.grad() - matmul(want, w0))).item() < 1e-5);
  }

  OpCase bm = matmul_case("bmm", {{2, 3, 4}, {2, 4, 5}}, {}, {{0, 3, 4}, {0, 4, 5}});
  bm.op = [](const Inputs& x) { return bmm(x[0], x[1]); };
  run_case(bm);

  OpCase op;
  op.name = "outer";
  op.shapes = {{3}, {4}};
  op.zero_shapes = {{0}, {4}};
  op.op = [](const Inputs& x) { return outer(x[0], x[1]); };
  op.reference = [](const Inputs& x) {
    return ref_matmul(x[0].reshape({-1, 1}), x[1].reshape({1, -1}));
  };
  run_case(op);

  OpCase sd;
  sd.name = "sq_dist";
  sd.shapes = {{5, 3}, {4, 3}};
  sd.broadcast_shapes = {{20, 7}, {9, 7}};
  sd.zero_shapes = {{0, 3}, {4, 3}};
  sd.op = [](const Inputs& x) { return sq_dist(x[0], x[1]); };
  sd.reference = [](const Inputs& x) { return ref_sq_dist(x[0], x[1]); };
  run_case(sd);
}

TEST_CASE("matmul on sizes that take the threaded and batch-parallel paths") {
  // Large enough for Eigen's blocked, threaded GEMM; every transpose layout.
  const Tensor a = make_input({70, 90}, Domain::any, 1), b = make_input({90, 60}, Domain::any, 2);
  const Tensor want = ref_matmul(a, b);
  CHECK(max_abs_diff(matmul(a, b), want) < 1e-10);
  const Tensor at = a.t().contiguous(), bt = b.t().contiguous();
  CHECK(max_abs_diff(matmul(at.t(), b), want) < 1e-10);
  CHECK(max_abs_diff(matmul(a, bt.t()), want) < 1e-10);
  CHECK(max_abs_diff(matmul(at.t(), bt.t()), want) < 1e-10);
  // f32 keeps its dtype and agrees to rounding.
  const Tensor c32 = matmul(a.to(DType::f32), b.to(DType::f32));
  CHECK(c32.dtype() == DType::f32);
  CHECK(max_abs_diff(c32, want) < 1e-3);

  // Many small products: spread over threads, one product per task.
  const Tensor x = make_input({16, 9, 7}, Domain::any, 3);
  const Tensor y = make_input({16, 7, 5}, Domain::any, 4);
  CHECK(max_abs_diff(matmul(x, y), ref_matmul(x, y)) < 1e-12);
  CHECK(max_abs_diff(matmul(x, select(y, 0, 0)), ref_matmul(x, select(y, 0, 0))) < 1e-12);
  // Few large products: one after another, each threaded by Eigen.
  const Tensor p = make_input({2, 140, 130}, Domain::any, 5);
  const Tensor q = make_input({2, 130, 150}, Domain::any, 6);
  CHECK(max_abs_diff(matmul(p, transpose(transpose(q, -1, -2).contiguous(), -1, -2)),
                     ref_matmul(p, q)) < 1e-10);
}

TEST_CASE("matmul and linear: 16-bit floats compute in f32 and keep their dtype") {
  const Tensor a = make_input({4, 6}, Domain::any, 7), b = make_input({6, 3}, Domain::any, 8);
  for (DType t : {DType::bf16, DType::f16}) {
    const Tensor a16 = a.to(t), b16 = b.to(t);
    const Tensor c = matmul(a16, b16);
    CHECK(c.dtype() == t);
    const Tensor want = ref_matmul(a16.to(DType::f64), b16.to(DType::f64));
    CHECK(max_abs_diff(c, want) < (t == DType::bf16 ? 0.1 : 0.02));
    const Tensor l = linear(a16, b16.t(), ones({3}, {.dtype = t}));
    CHECK(l.dtype() == t);
    CHECK(max_abs_diff(l, want + 1.0) < (t == DType::bf16 ? 0.1 : 0.02));
  }
  // Mixed dtypes promote.
  CHECK(matmul(a.to(DType::f32), b).dtype() == DType::f64);
}

TEST_CASE("matmul gradients reach both operands with the right shapes") {
  const Tensor a = make_input({2, 1, 3, 4}, Domain::any, 9).requires_grad_();
  const Tensor b = make_input({5, 4, 2}, Domain::any, 10).requires_grad_();
  const Tensor y = matmul(a, b);
  CHECK(y.shape() == Shape{2, 5, 3, 2});
  sum(y).backward();
  CHECK(a.grad().shape() == a.shape());
  CHECK(b.grad().shape() == b.shape());
  // d sum(a b) / d a[..., i, p] = sum over broadcast batch and j of b[..., p, j].
  const auto ga = a.grad().to_vector<double>();
  const auto bv = b.to_vector<double>();
  double want = 0;
  for (int64_t t = 0; t < 5; ++t)
    for (int64_t j = 0; j < 2; ++j) want += bv[(t * 4 + 1) * 2 + j];
  CHECK(ga[1] == doctest::Approx(want));
  // Only the operand that needs a gradient gets one.
  const Tensor w = make_input({4, 3}, Domain::any, 11).requires_grad_();
  const Tensor x = make_input({6, 4}, Domain::any, 12);
  sum(matmul(x, w)).backward();
  CHECK(w.grad().defined());
}

TEST_CASE("linear: an input read by several layers gets its gradient summed by the GEMMs") {
  // Each linear's input gradient after the first is added onto the sum the
  // engine hands over (gradient_sink) by its GEMM; the sum equals the
  // gradients taken one layer at a time. A transposed weight (strided) and a
  // 3-d input take the same path.
  for (const DType dt : {DType::f32, DType::f64}) {
    CAPTURE(dt);
    Generator gen(31);
    const TensorOptions o{.dtype = dt};
    const Tensor x0 = randn({2, 9, 12}, gen, o);
    const Tensor w1 = randn({7, 12}, gen, o), b1 = randn({7}, gen, o);
    const Tensor w2 = transpose(randn({12, 5}, gen, o), 0, 1);
    const Tensor w3 = randn({4, 12}, gen, o), c3 = randn({2, 9, 4}, gen, o);
    const std::vector<std::function<Tensor(const Tensor&)>> layers{
        [&](const Tensor& x) { return linear(x, w1, b1); },
        [&](const Tensor& x) { return linear(x, w2); },
        [&](const Tensor& x) { return linear_add(c3.clone(), x, w3); },
    };
    Tensor alone = zeros_like(x0);
    std::vector<Tensor> probes;
    for (const auto& layer : layers) {
      Tensor x = x0.clone().requires_grad_();
      const Tensor y = layer(x);
      probes.push_back(randn(y.shape(), gen, o));
      sum(y * probes.back()).backward();
      alone = alone + x.grad();
    }
    Tensor x = x0.clone().requires_grad_();
    const Tensor h = x * 1.0;
    Tensor loss = sum(layers[0](h) * probes[0]);
    for (size_t i = 1; i < layers.size(); ++i) loss = loss + sum(layers[i](h) * probes[i]);
    loss.backward();
    const double tol = dt == DType::f32 ? 1e-5 : 1e-13;
    CHECK(max(abs(x.grad() - alone)).item() <= tol * max(abs(alone)).item());
  }
}

TEST_CASE("matrix products name the op and the problem in their errors") {
  const Tensor a = ones({2, 3}), b = ones({4, 5});
  CHECK_THROWS_WITH_AS(matmul(a, b), doctest::Contains("[matmul] inner dimensions differ"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(matmul(a, b), doctest::Contains("[2, 3] and [4, 5]"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(matmul(scalar(1.0), a), doctest::Contains("at least 1 dim"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(matmul(ones({2, 2, 3}), ones({3, 3, 4})), doctest::Contains("[matmul]"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(
      matmul(ones({2, 3}, {.dtype = DType::i64}), ones({3, 2}, {.dtype = DType::i64})),
      doctest::Contains("[matmul] needs floating operands: got i64 and i64"),
      std::invalid_argument);
  CHECK_THROWS_WITH_AS(bmm(ones({2, 3}), ones({3, 2})), doctest::Contains("[bmm] needs 3-d"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(bmm(ones({2, 2, 3}), ones({3, 3, 2})),
                       doctest::Contains("[bmm] batch sizes differ"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(linear(ones({2, 3}), ones({4, 5})),
                       doctest::Contains("[linear] input's last dim"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(linear(ones({2, 3}), ones({4, 3}), ones({3})),
                       doctest::Contains("[linear] bias must have shape [4]"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(outer(ones({2, 2}), ones({2})), doctest::Contains("[outer] needs 1-d"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(sq_dist(ones({2, 3}), ones({4, 2})), doctest::Contains("[sq_dist]"),
                       std::invalid_argument);
}

TEST_CASE("sq_dist on every test device: rows short and long (each lane layout of CUDA's norms)") {
  // CUDA sums a row's squares with 1, 8 or 32 lanes by its length
  // (cuda::row_lanes); more rows than one warp holds, and a partial last warp.
  for (const Device dev : quanta::testing::test_devices()) {
    for (const int64_t d : {3, 16, 40, 300}) {
      const std::string at = dev.str() + " d " + std::to_string(d);
      INFO(at);
      const Tensor x = make_input({37, d}, Domain::any, 5 + d);
      const Tensor c = make_input({70, d}, Domain::any, 6 + d);
      for (const DType dt : {DType::f64, DType::f32}) {
        const Tensor want = sq_dist(x.to(dt), c.to(dt)).to(DType::f64);
        const Tensor got = sq_dist(x.to(dt).to(dev), c.to(dt).to(dev)).to(Device::cpu());
        const auto w = want.to_vector<double>(), g = got.to(DType::f64).to_vector<double>();
        const double tol = dt == DType::f64 ? 1e-10 : 1e-4;
        for (size_t i = 0; i < w.size(); ++i)
          CHECK(g[i] == doctest::Approx(w[i]).epsilon(tol).scale(double(d)));
      }
    }
  }
}

TEST_CASE("sq_dist is exactly zero for identical rows and never negative") {
  const Tensor x = make_input({6, 5}, Domain::any, 13) * 10.0;
  const Tensor d = sq_dist(x.to(DType::f32), x.to(DType::f32));
  const auto v = d.to_vector<double>();
  for (int64_t i = 0; i < 6; ++i) {
    CHECK(v[i * 6 + i] < 1e-2);  // cancellation leaves at most rounding noise
    for (int64_t j = 0; j < 6; ++j) CHECK(v[i * 6 + j] >= 0.0);
  }
}
