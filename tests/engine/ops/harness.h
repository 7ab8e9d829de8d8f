#pragma once
// The table-driven op harness (after ggml's test-backend-ops): every op is one
// OpCase row, and `run_case` checks it the same way:
//   forward      against a naive reference written with plain loops (f64);
//   gradient     f64 central differences vs autograd, for every floating input;
//   strided      inputs as non-contiguous views give the same values and grads;
//   broadcast    (if `broadcast_shapes` is set) forward + gradient again;
//   zero-size    (if `zero_shapes` is set) forward runs, shape matches the
//                reference, backward runs;
//   16-bit       (if `half` is set) forward in bf16 and f16 against the f64
//                reference on the rounded inputs, per-dtype tolerances;
//   device axis  on every CUDA device the build sees, each variant in f64 and
//                f32: forward and gradients equal the CPU's; with `half`,
//                bf16 and f16 forwards against the f64 reference too (one
//                skip line when the build or the machine has no GPU).
#include <functional>
#include <string>
#include <vector>

#include "quanta.h"

namespace quanta::testing {

using Inputs = std::vector<Tensor>;
using OpFn = std::function<Tensor(const Inputs&)>;

/** Values the random inputs are drawn from. */
enum class Domain {
  any,             // uniform in [-2, 2]
  positive,        // uniform in [0.5, 2]   (log, sqrt, pow bases, divisors)
  unit,            // uniform in (-0.9, 0.9) (atanh-like domains)
  away_from_zero,  // |x| in [0.3, 2]: kinks of abs, relu, sign-based grads
  distinct,        // a shuffled arithmetic sequence: no ties (max, sort-like ops)
};

/** How input k is made: a floating input from a Domain, or a custom maker
 * (indices, masks) that returns a tensor of the requested shape. */
struct InputSpec {
  Domain domain = Domain::any;
  std::function<Tensor(const Shape& shape, uint64_t seed)> make;  // overrides domain
  bool differentiable = true;                                     // include in the gradient check
};

/** An input drawn from domain `d`. */
inline InputSpec spec(Domain d) {
  InputSpec s;
  s.domain = d;
  return s;
}
/** An input made by `make(shape, seed)`. */
inline InputSpec spec(std::function<Tensor(const Shape&, uint64_t)> make) {
  InputSpec s;
  s.make = std::move(make);
  return s;
}

struct OpCase {
  std::string name;
  std::vector<Shape> shapes;            // main variant's input shapes
  OpFn op;                              // the quanta op under test
  OpFn reference;                       // naive loops over to_vector<double>()
  std::vector<InputSpec> inputs;        // per input (defaults: Domain::any)
  std::vector<Shape> broadcast_shapes;  // optional broadcasting variant
  std::vector<Shape> zero_shapes;       // optional zero-size variant
  bool grad = true;                     // false for (nd) ops
  double fwd_tol = 1e-5;                // relative tolerance of forward (f32 run)
  double grad_tol = 1e-6;               // tolerance of the f64 gradient check
  bool half = false;                    // also check bf16 and f16 forwards
};

/** Relative tolerance of a 16-bit forward against the f64 reference: two
 * units of roundoff of the dtype (one rounding of an f32-accumulated result,
 * with room for the order of the sum). */
double half_tol(DType t);

/** Runs every variant of `c`; failures are reported through doctest. */
void run_case(const OpCase& c);

/** Deterministic input tensor of `shape` (f64) drawn from `d`. */
Tensor make_input(const Shape& shape, Domain d, uint64_t seed);

/** Reference helper: applies f to every element (broadcasting all inputs to
 * the output shape). Returns an f64 tensor. */
Tensor ref_elementwise(const Inputs& xs,
                       const std::function<double(const std::vector<double>&)>& f);

/** Reference helper: reduces `x` over `dims` (empty = all) with `f`, which
 * receives the values of one output element's slice. */
Tensor ref_reduce(const Tensor& x, std::vector<int64_t> dims, bool keepdim,
                  const std::function<double(const std::vector<double>&)>& f);

/** Multi-index helpers for writing references with plain loops. */
std::vector<int64_t> unravel(int64_t flat, const Shape& shape);
int64_t ravel(const std::vector<int64_t>& idx, const Shape& shape);

}  // namespace quanta::testing
