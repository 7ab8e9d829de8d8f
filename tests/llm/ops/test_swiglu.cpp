// swiglu: op-harness rows (f64 finite differences, zero-size, 16-bit, every
// device), the two ops it replaces bit for bit, the memory it holds, errors.
#include <doctest/doctest.h>

#include <cmath>

#include "engine/cpu/block_cache.h"
#include "engine/ops/harness.h"
#include "llm/ops/swiglu.h"

using namespace quanta;
using namespace quanta::testing;

TEST_CASE("swiglu: op harness") {
  OpCase c;
  c.name = "swiglu";
  c.shapes = {{3, 4, 8}, {3, 4, 8}};
  c.zero_shapes = {{0, 8}, {0, 8}};
  c.op = [](const Inputs& xs) { return llm::swiglu(xs[0], xs[1]); };
  c.reference = [](const Inputs& xs) {
    return ref_elementwise(
        xs, [](const std::vector<double>& v) { return v[0] / (1 + std::exp(-v[0])) * v[1]; });
  };
  c.half = true;
  run_case(c);
}

TEST_CASE("swiglu: mul(silu(gate), up) bit for bit, forward and backward, holding less") {
  Generator gen(3);
  const Tensor g0 = randn({64, 96}, gen), u0 = randn({64, 96}, gen), probe = randn({64, 96}, gen);
  Tensor g1 = g0.clone().requires_grad_(), u1 = u0.clone().requires_grad_();
  Tensor g2 = g0.clone().requires_grad_(), u2 = u0.clone().requires_grad_();
  const Tensor y1 = llm::swiglu(g1, u1), y2 = mul(silu(g2), u2);
  CHECK(max(abs(y1 - y2)).item() == 0);
  sum(y1 * probe).backward();
  sum(y2 * probe).backward();
  CHECK(max(abs(g1.grad() - g2.grad())).item() == 0);
  CHECK(max(abs(u1.grad() - u2.grad())).item() == 0);
  // Large inputs (cached blocks, counted where the cache is on): the graph
  // holds the output only, no silu(gate).
  const Tensor gate = randn({1024, 1024}, gen).requires_grad_(),
               up = randn({1024, 1024}, gen).requires_grad_();  // 4 MiB each
  const std::size_t before = cpu::block_cache_stats().in_use;
  const Tensor y = llm::swiglu(gate, up);
  if (cpu::block_cache_stats().bound > 0)
    CHECK(cpu::block_cache_stats().in_use == before + y.nbytes());
}

TEST_CASE("swiglu: clear errors") {
  CHECK_THROWS_WITH_AS(llm::swiglu(zeros({2, 3}), zeros({3, 2})),
                       doctest::Contains("[swiglu] gate and up must share shape"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(
      llm::swiglu(zeros({2}, {.dtype = DType::i64}), zeros({2}, {.dtype = DType::i64})),
      doctest::Contains("swiglu"), std::invalid_argument);
}
