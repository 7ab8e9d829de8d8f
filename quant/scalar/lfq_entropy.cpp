#include "quant/scalar/lfq_entropy.h"

#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/autograd/function.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/join.h"
#include "engine/ops/linalg.h"
#include "engine/ops/reduce.h"
#include "engine/ops/softmax.h"
#include "engine/ops/view.h"
#include "quant/kernels/table.h"

namespace quanta::quant {
namespace {

// mean over codebooks of H_eps(avg), avg [C, K].
Tensor clamped_entropy_mean(const Tensor& avg) {
  const Tensor h = -sum(avg * log(clamp(avg, kEntropyEps, NAN)), {-1});
  return mean(h);
}

}  // namespace

// Product distributions of pi [R, k, 2] -> [R, 2^k], differentiable in pi.
// One kernel rather than k broadcast multiplies: the engine's broadcasting
// kernels are slow on runs of length 1 and 2.
Tensor bit_product_distribution(const Tensor& pi) {
  if (pi.dim() != 3 || pi.size(2) != 2)
    throw std::invalid_argument("[bit_product_distribution] expects [rows, bits, 2], got " +
                                shape_str(pi.shape()));
  if (pi.dtype() != DType::f32 && pi.dtype() != DType::f64)
    throw std::invalid_argument("[LFQ] bit probabilities must be f32 or f64");
  auto saved = std::make_shared<Tensor>();
  autograd::Function fn;
  fn.name = "lfq_bit_product";
  fn.forward = [saved](const std::vector<Tensor>& in) {
    const Tensor p = in[0].contiguous();
    *saved = p;
    const int64_t R = p.size(0), k = p.size(1), n = int64_t(1) << k;
    Tensor out = empty({R, n}, {.dtype = p.dtype(), .device = p.device()});
    quant_kernels(p.device()).bit_product(p.dtype(), p.raw_data(), R, k, out.raw_data());
    return std::vector<Tensor>{out};
  };
  fn.backward = [saved](const std::vector<Tensor>& g) {
    const Tensor& p = *saved;
    const Tensor gp = g[0].to(p.dtype()).contiguous();
    const QuantKernelTable& kernels = quant_kernels_for("lfq_bit_product", {&p, &gp});
    const int64_t R = p.size(0), k = p.size(1);
    Tensor out = empty({R, k, 2}, {.dtype = p.dtype(), .device = p.device()});
    kernels.bit_product_grad(p.dtype(), p.raw_data(), gp.raw_data(), R, k, out.raw_data());
    return std::vector<Tensor>{out};
  };
  return autograd::apply(fn, {pi})[0];
}

std::vector<Tensor> bit_probability_halves(const Tensor& bit_logits, int64_t high) {
  if (bit_logits.dim() != 2)
    throw std::invalid_argument("[LFQ] bit logits must be [rows, bits], got " +
                                shape_str(bit_logits.shape()));
  const int64_t d = bit_logits.size(1);
  if (high < 0 || high > d)
    throw std::invalid_argument("[LFQ] a split after bit " + std::to_string(high) + " of " +
                                std::to_string(d));
  auto saved = std::make_shared<Tensor>();
  autograd::Function fn;
  fn.name = "lfq_bit_probabilities";
  fn.forward = [saved, high](const std::vector<Tensor>& in) {
    const Tensor z = in[0].contiguous();
    *saved = z;
    const int64_t R = z.size(0), d = z.size(1);
    const QuantKernelTable& kernels = quant_kernels(z.device());
    std::vector<Tensor> out;
    for (const auto& [begin, k] : {std::pair{int64_t{0}, high}, std::pair{high, d - high}}) {
      out.push_back(empty({R, k, 2}, {.dtype = z.dtype(), .device = z.device()}));
      kernels.bit_probabilities(z.dtype(), z.raw_data(), R, d, begin, k, out.back().raw_data());
    }
    return out;
  };
  fn.backward = [saved, high](const std::vector<Tensor>& g) {
    const Tensor& z = *saved;
    const int64_t R = z.size(0), d = z.size(1);
    // Each half writes its own columns: together every column, once.
    Tensor dz = empty({R, d}, {.dtype = z.dtype(), .device = z.device()});
    const std::pair<int64_t, int64_t> halves[2] = {{0, high}, {high, d - high}};
    for (int i = 0; i < 2; ++i) {
      const Tensor gi = g[size_t(i)].to(z.dtype()).contiguous();
      const QuantKernelTable& kernels = quant_kernels_for("lfq_bit_probabilities", {&z, &gi});
      kernels.bit_probabilities_grad(z.dtype(), z.raw_data(), gi.raw_data(), R, d, halves[i].first,
                                     halves[i].second, dz.raw_data());
    }
    return std::vector<Tensor>{dz};
  };
  return autograd::apply(fn, {bit_logits});
}

Tensor local_token_mean(const Tensor& sum, int64_t count) {
  return count > 0 ? sum / double(count) : sum;
}

Tensor clamped_bit_product_entropy(const Tensor& bit_logits) {
  if (bit_logits.dim() != 2)
    throw std::invalid_argument("[LFQ] bit logits must be [rows, bits], got " +
                                shape_str(bit_logits.shape()));
  auto grad = std::make_shared<Tensor>();
  autograd::Function fn;
  fn.name = "lfq_clamped_entropy";
  fn.forward = [grad](const std::vector<Tensor>& in) {
    const Tensor z = in[0].to(DType::f64).contiguous();
    const int64_t R = z.size(0), d = z.size(1);
    Tensor h = empty({R}, {.dtype = DType::f64, .device = z.device()});
    *grad = empty({R, d}, {.dtype = DType::f64, .device = z.device()});
    quant_kernels(z.device())
        .clamped_entropy(static_cast<const double*>(z.raw_data()), R, d,
                         static_cast<double*>(h.raw_data()),
                         static_cast<double*>(grad->raw_data()));
    return std::vector<Tensor>{h.to(in[0].dtype())};
  };
  fn.backward = [grad](const std::vector<Tensor>& g) {
    const Tensor dz = grad->to(g[0].dtype());
    return std::vector<Tensor>{unsqueeze(g[0], -1) * dz};
  };
  return autograd::apply(fn, {bit_logits})[0];
}

LFQEntropy lfq_entropy_factorised(const Tensor& z, const TokenMean& token_mean) {
  if (z.dim() != 3)
    throw std::invalid_argument("[LFQ] bit logits must be [tokens, codebooks, bits], got " +
                                shape_str(z.shape()));
  const int64_t T = z.size(0), C = z.size(1), d = z.size(2);
  LFQEntropy out;
  // Per-token entropies averaged over codebooks, then over tokens through
  // token_mean (a cross-rank mean in a distributed run).
  out.per_sample =
      token_mean(sum(clamped_bit_product_entropy(reshape(z, {T * C, d}))) / double(C), T);
  // P(bit = 0) and P(bit = 1) as sigmoid(-z), sigmoid(z): each accurate in
  // its tail; the two halves of the bits, each made whole.
  const int64_t high = d / 2;
  const std::vector<Tensor> pi = bit_probability_halves(reshape(z, {T * C, d}), high);
  const Tensor A = reshape(bit_product_distribution(pi[0]), {T, C, int64_t(1) << high});
  const Tensor B = reshape(bit_product_distribution(pi[1]), {T, C, int64_t(1) << (d - high)});
  const Tensor sum_ab = bmm(contiguous(permute(A, {1, 2, 0})), contiguous(permute(B, {1, 0, 2})));
  const Tensor avg = token_mean(reshape(sum_ab, {C, A.size(2) * B.size(2)}), T);  // [C, 2^d]
  out.batch = clamped_entropy_mean(avg);
  return out;
}

LFQEntropy lfq_entropy_direct(const Tensor& x, const Tensor& codebook, double inv_temperature,
                              const TokenMean& token_mean) {
  if (x.dim() != 3)
    throw std::invalid_argument("[LFQ] direct entropy expects [tokens, codebooks, bits], got " +
                                shape_str(x.shape()));
  const int64_t T = x.size(0);
  const Tensor logits = matmul(x, codebook.t().to(x.dtype())) * (2.0 * inv_temperature);
  const Tensor p = softmax(logits, -1);  // [T, C, K]
  LFQEntropy out;
  const int64_t C = x.size(1);
  out.per_sample = token_mean(sum(-sum(p * log(clamp(p, kEntropyEps, NAN)), {-1})) / double(C), T);
  out.batch = clamped_entropy_mean(token_mean(sum(p, {0}), T));
  return out;
}

}  // namespace quanta::quant
