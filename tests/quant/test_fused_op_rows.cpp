// The quantizer's fused ops as op-harness rows (tests/engine/ops/harness.h):
// forward against a naive f64 reference, f64 finite-difference gradients,
// strided inputs, zero-size inputs, and, on a machine with a GPU, every row
// again on cuda:0 against the CPU (through the CUDA quantizer table).
#include <doctest/doctest.h>

#include <limits>
#include <vector>

#include "engine/ops/harness.h"
#include "quant/nf4/nf4_format.h"
#include "quant/nf4/nf4_linear.h"
#include "quant/vq/commitment_loss.h"
#include "quant/vq/nearest_code.h"
#include "quant/vq/rotation_trick.h"
#include "quanta.h"

using namespace quanta;
using namespace quanta::testing;

namespace {

// mean((q - x)^2) over the rows whose weight is non-zero (all rows when
// `valid` is undefined); 0 when nothing counts, as commitment_loss says.
Tensor ref_commitment(const Tensor& x, const Tensor& q, const Tensor& valid) {
  const auto a = x.to_vector<double>(), b = q.to_vector<double>();
  const int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  const auto keep = valid.defined() ? valid.to(DType::f64).to_vector<double>()
                                    : std::vector<double>(static_cast<size_t>(rows), 1.0);
  double total = 0, count = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (keep[r] == 0) continue;
    count += 1;
    for (int64_t e = 0; e < d; ++e)
      total += (b[r * d + e] - a[r * d + e]) * (b[r * d + e] - a[r * d + e]);
  }
  return scalar(count > 0 ? total / (count * double(d)) : 0.0, {.dtype = DType::f64});
}

}  // namespace

TEST_CASE("op harness: commitment_loss, with and without a row mask") {
  OpCase plain;
  plain.name = "commitment_loss";
  plain.shapes = {{6, 5}, {6, 5}};
  plain.zero_shapes = {{0, 5}, {0, 5}};
  plain.op = [](const Inputs& x) { return quant::commitment_loss(x[0], x[1]); };
  plain.reference = [](const Inputs& x) { return ref_commitment(x[0], x[1], Tensor()); };
  run_case(plain);

  OpCase masked = plain;
  masked.name = "commitment_loss masked";
  masked.shapes = {{6, 5}, {6, 5}, {6}};
  masked.zero_shapes = {{0, 5}, {0, 5}, {0}};
  InputSpec mask = spec([](const Shape& shape, uint64_t seed) {
    std::vector<bool> v;
    for (int64_t i = 0; i < numel_of(shape); ++i) v.push_back((i * 7 + seed) % 3 != 0);
    return from_vector<bool>(v, shape);
  });
  mask.differentiable = false;
  masked.inputs = {InputSpec{}, InputSpec{}, mask};
  masked.op = [](const Inputs& x) { return quant::commitment_loss(x[0], x[1], x[2]); };
  masked.reference = [](const Inputs& x) { return ref_commitment(x[0], x[1], x[2]); };
  run_case(masked);
}

TEST_CASE("op harness: nearest_codes (euclidean), rotate_to's value") {
  OpCase nearest;
  nearest.name = "nearest_codes";
  nearest.shapes = {{7, 4}, {5, 4}};
  nearest.zero_shapes = {{0, 4}, {5, 4}};
  nearest.inputs = {spec(Domain::distinct), spec(Domain::distinct)};
  nearest.grad = false;
  nearest.op = [](const Inputs& x) { return quant::nearest_codes(x[0], x[1], false); };
  nearest.reference = [](const Inputs& x) {
    const auto a = x[0].to_vector<double>(), c = x[1].to_vector<double>();
    const int64_t n = x[0].size(0), k = x[1].size(0), d = x[0].size(1);
    std::vector<int64_t> out;
    for (int64_t i = 0; i < n; ++i) {
      int64_t best = 0;
      double best_d = std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < k; ++j) {
        double s = 0;
        for (int64_t e = 0; e < d; ++e)
          s += (a[i * d + e] - c[j * d + e]) * (a[i * d + e] - c[j * d + e]);
        if (s < best_d) best_d = s, best = j;
      }
      out.push_back(best);
    }
    return from_vector<int64_t>(out, {n});
  };
  run_case(nearest);

  // The rotation trick's value is the code itself; its gradient is a chosen
  // estimator, not the derivative of that value, so it has no row of its own
  // (tests/quant/vq/test_gradients.cpp checks it in closed form).
  OpCase rotate;
  rotate.name = "rotate_to (value)";
  rotate.shapes = {{4, 6}, {4, 6}};
  rotate.zero_shapes = {{0, 6}, {0, 6}};
  rotate.grad = false;
  rotate.op = [](const Inputs& x) { return quant::rotate_to(x[0], x[1]); };
  rotate.reference = [](const Inputs& x) { return x[1].to(DType::f64); };
  run_case(rotate);
}

TEST_CASE("op harness: nf4_linear (a frozen NF4 weight, gradients for x and the bias)") {
  OpCase lin;
  lin.name = "nf4_linear";
  lin.shapes = {{3, 64}, {4, 64}, {4}};
  lin.zero_shapes = {{0, 64}, {4, 64}, {4}};
  InputSpec weight;
  weight.differentiable = false;  // quantized inside the op: frozen
  lin.inputs = {InputSpec{}, weight, InputSpec{}};
  lin.fwd_tol = 1e-5;
  lin.op = [](const Inputs& x) {
    return quant::nf4_linear(x[0], quant::quantize_nf4(x[1].detach()), x[2]);
  };
  lin.reference = [](const Inputs& x) {
    const Tensor w = quant::dequantize(quant::quantize_nf4(x[1])).to(DType::f64);
    const auto a = x[0].to_vector<double>(), wv = w.to_vector<double>(),
               b = x[2].to_vector<double>();
    const int64_t n = x[0].size(0), in = x[0].size(1), out = w.size(0);
    std::vector<double> y;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t o = 0; o < out; ++o) {
        double s = b[o];
        for (int64_t e = 0; e < in; ++e) s += a[i * in + e] * wv[o * in + e];
        y.push_back(s);
      }
    return from_vector<double>(y, {n, out});
  };
  run_case(lin);
}
