// Quantizers under MixedPrecision (engine/precision.h): their own math
// (projections, distances, codebook updates, rounding, entropies) stays f32,
// as vector-quantize-pytorch turns autocast off there. A forward and its
// gradients under the guard give the bits of the same forward without it.
// Named "bf16 products" so the bf16_products_forced test runs it too.
#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <vector>

#include "quant/scalar/fsq.h"
#include "quant/scalar/lfq.h"
#include "quant/vq/vector_quantize.h"
#include "quanta.h"
#include "support/bf16_products.h"

using namespace quanta;
using namespace quanta::quant;

namespace {

struct Run {
  std::vector<float> quantized, loss, grad;
  std::vector<int64_t> indices;
};

// One training forward of a fresh layer (seeded alike) and the input's
// gradient, with MixedPrecision on or off.
Run run(const std::function<std::shared_ptr<Quantizer>(Generator&)>& make, bool mixed) {
  Generator init(5), data(6);
  const std::shared_ptr<Quantizer> q = make(init);
  q->train(true);
  // 1024 tokens of 512 features: the projections are products of over 2^20
  // multiply-adds, which the CPU would take in bf16.
  const Tensor x = randn({4, 256, 512}, data).requires_grad_(true);
  Run r;
  {
    const MixedPrecision precision(mixed);
    const QuantizeOutput out = q->forward(x, Tensor(), {});
    (sum(out.quantized) + sum(out.loss)).backward();
    r.quantized = out.quantized.detach().to_vector<float>();
    r.loss = out.loss.detach().to_vector<float>();
    r.indices = out.indices.to(DType::i64).to_vector<int64_t>();
  }
  r.grad = x.grad().to_vector<float>();
  return r;
}

}  // namespace

TEST_CASE("quantizers under MixedPrecision keep f32 math (no bf16 products)") {
  if (!quanta::testing::bf16_products_or_skip("quant_bf16_products_forced")) return;
  const std::vector<std::pair<const char*, std::function<std::shared_ptr<Quantizer>(Generator&)>>>
      layers = {
          {"vq",
           [](Generator& g) {
             VectorQuantizeOptions o;
             o.dim = 512;
             o.codebook_size = 256;
             o.codebook_dim = 64;
             return std::make_shared<VectorQuantize>(o, g);
           }},
          {"fsq",
           [](Generator& g) {
             FSQOptions o;
             o.levels = {8, 5, 5, 5};
             o.dim = 512;
             return std::make_shared<FSQ>(o, g);
           }},
          {"lfq",
           [](Generator& g) {
             LFQOptions o;
             o.dim = 512;
             o.codebook_size = 1024;
             return std::make_shared<LFQ>(o, g);
           }},
      };
  for (const auto& [name, make] : layers) {
    CAPTURE(name);
    const Run plain = run(make, false), mixed = run(make, true);
    CHECK(mixed.indices == plain.indices);
    CHECK(mixed.quantized == plain.quantized);
    CHECK(mixed.loss == plain.loss);
    CHECK(mixed.grad == plain.grad);
  }
}
