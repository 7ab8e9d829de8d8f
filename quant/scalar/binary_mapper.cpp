#include "quant/scalar/binary_mapper.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/join.h"
#include "engine/ops/loss.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "engine/precision.h"
#include "engine/random/sampling.h"
#include "quant/scalar/lfq_entropy.h"
#include "quant/streams.h"

namespace quanta::quant {

BinaryMapper::BinaryMapper(BinaryMapperOptions opts, Generator& gen)
    : Module("BinaryMapper"),
      opts_(opts),
      gen_(Generator::named(draw_seed(gen), "binary_mapper.sample")) {
  if (opts_.bits < 1 || opts_.bits > 24)
    throw std::invalid_argument("[BinaryMapper] bits must lie in [1, 24], got " +
                                std::to_string(opts_.bits));
}

QuantizeOutput BinaryMapper::forward(const Tensor& logits, const BinaryMapperCall& call) {
  const MixedPrecision f32_math(false);  // quantizer math stays f32 (engine/precision.h)
  const int64_t k = opts_.bits;
  if (logits.dim() < 1 || logits.size(-1) != k)
    throw std::invalid_argument("[BinaryMapper] logits must end in bits = " + std::to_string(k) +
                                ", got " + shape_str(logits.shape()));
  if (!(call.temperature > 0))
    throw std::invalid_argument("[BinaryMapper] temperature must be > 0");
  const bool training = is_training();
  const bool deterministic = call.deterministic.value_or(opts_.deterministic_on_eval && !training);
  const bool straight = call.straight_through.value_or(training);
  const bool aux = call.calc_aux_loss.value_or(training);

  const Tensor p = sigmoid(logits.detach() / call.temperature);
  const Tensor bits =
      deterministic ? gt(p, constant_like(p, 0.5))
                    : lt(rand(p.shape(), gen_.next(), {.dtype = DType::f64, .device = p.device()}),
                         p.to(DType::f64));
  std::vector<int64_t> powers(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) powers[i] = int64_t(1) << i;
  const Tensor indices =
      sum(bits.to(DType::i64) *
              from_vector<int64_t>(powers, {k}, {.dtype = DType::i64, .device = p.device()}),
          {-1});
  const DType ft = is_floating(logits.dtype()) ? logits.dtype() : DType::f32;
  Tensor one_hot_codes = one_hot(indices, num_codes()).to(ft);
  if (straight) {
    // Code probabilities of the factorised distribution; bit 0 is the least
    // significant, so flip the bits into bit_product_distribution's order.
    const Shape lead(logits.shape().begin(), logits.shape().end() - 1);
    const int64_t rows = logits.numel() / k;
    const Tensor pi = stack({sigmoid(-logits), sigmoid(logits)}, -1);  // [..., k, 2]
    const Tensor probs =
        bit_product_distribution(flip(reshape(pi, {rows, k, 2}), {1}));  // [rows, 2^k]
    Shape out = lead;
    out.push_back(num_codes());
    const Tensor g = reshape(probs, out);
    one_hot_codes = one_hot_codes + g - g.detach();
  }
  QuantizeOutput r;
  r.quantized = one_hot_codes;
  r.indices = indices;
  Tensor loss = zeros({}, {.dtype = ft, .device = logits.device()});
  if (aux && logits.numel() > 0) {
    // KL(bits || uniform) = bits ln 2 - sum_i H(sigmoid(logit_i))
    const Tensor q = sigmoid(logits);
    const Tensor h = -(q * log(clamp(q, 1e-20, NAN)) + (1.0 - q) * log(clamp(1.0 - q, 1e-20, NAN)));
    const Tensor kl = double(k) * std::log(2.0) - sum(h, {-1});
    loss = relu(kl - opts_.kl_loss_threshold);
    if (call.reduce_aux_kl_loss) loss = mean(loss);
  }
  r.loss = loss;
  r.losses = {{"kl", loss}};
  return r;
}

Tensor BinaryMapper::forward(const Tensor& logits) {
  return forward(logits, BinaryMapperCall{}).quantized;
}

}  // namespace quanta::quant
