#include "quant/nf4/residual_init.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/linalg.h"
#include "engine/ops/qr.h"
#include "engine/ops/svd.h"
#include "engine/ops/view.h"

namespace quanta::quant {

namespace {

// The weight in the precision the decomposition runs in, with its rank checked.
Tensor decomposed_weight(const ResidualStartLayer& l, std::size_t index, const char* who) {
  const std::string where = std::string("[") + who + "] layer " + std::to_string(index) + ": ";
  if (l.weight.dim() != 2)
    throw std::invalid_argument(where + "the weight must be a matrix, got " +
                                shape_str(l.weight.shape()));
  const int64_t most = std::min(l.weight.shape()[0], l.weight.shape()[1]);
  if (l.rank < 1 || l.rank > most)
    throw std::invalid_argument(where + "rank " + std::to_string(l.rank) + " is outside [1, " +
                                std::to_string(most) + "] for a " + shape_str(l.weight.shape()) +
                                " weight");
  return l.weight.detach().to(l.weight.dtype() == DType::f64 ? DType::f64 : DType::f32);
}

// The residual the factors leave, and the factors as the layer keeps them.
ResidualStart start_of(const Tensor& weight, const Tensor& a, const Tensor& b,
                       const ResidualStartLayer& layer) {
  const bool rounds = layer.factor_dtype != DType::f32 && layer.factor_dtype != DType::f64;
  return {rounds ? a.to(layer.factor_dtype).to(a.dtype()) : a,
          rounds ? b.to(layer.factor_dtype).to(b.dtype()) : b, a, b,
          weight - matmul(b, a) * layer.scaling};
}

}  // namespace

std::vector<ResidualStart> pissa_starts(const std::vector<ResidualStartLayer>& layers,
                                        int64_t niter, std::vector<Generator>* gens) {
  NoGradGuard no_grad;
  std::vector<Tensor> weights;
  std::vector<int64_t> ranks;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    weights.push_back(decomposed_weight(layers[i], i, "pissa_starts"));
    ranks.push_back(layers[i].rank);
  }
  if (niter >= 0 && (gens == nullptr || gens->size() != layers.size()))
    throw std::invalid_argument("[pissa_starts] niter " + std::to_string(niter) +
                                " needs one generator per layer");
  const std::vector<SingularTriplets> svds =
      niter < 0 ? top_singular_triplets(weights, ranks)
                : approximate_singular_triplets(weights, ranks, niter, *gens);
  std::vector<ResidualStart> out;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const SingularTriplets& t = svds[i];
    // sqrt(S / scaling) on both factors: scaling B A = U S Vh.
    const Tensor root = sqrt(t.s / layers[i].scaling);
    out.push_back(
        start_of(weights[i], unsqueeze(root, 1) * t.vh, t.u * unsqueeze(root, 0), layers[i]));
  }
  return out;
}

std::vector<ResidualStart> olora_starts(const std::vector<ResidualStartLayer>& layers) {
  NoGradGuard no_grad;
  std::vector<Tensor> weights;
  for (std::size_t i = 0; i < layers.size(); ++i)
    weights.push_back(decomposed_weight(layers[i], i, "olora_starts"));
  const std::vector<ThinQR> qrs = thin_qr(weights);
  std::vector<ResidualStart> out;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const int64_t r = layers[i].rank;
    const Tensor a = narrow(qrs[i].r, 0, 0, r).contiguous();
    const Tensor b = narrow(qrs[i].q, 1, 0, r).contiguous();
    out.push_back(start_of(weights[i], a, b, layers[i]));
  }
  return out;
}

ResidualStart given_start(const ResidualStartLayer& layer, const Tensor& a, const Tensor& b) {
  NoGradGuard no_grad;
  const Tensor weight = decomposed_weight(layer, 0, "given_start");
  const int64_t out = weight.shape()[0], in = weight.shape()[1];
  if (a.shape() != Shape{layer.rank, in} || b.shape() != Shape{out, layer.rank})
    throw std::invalid_argument("[given_start] A " + shape_str(a.shape()) + " and B " +
                                shape_str(b.shape()) + " for a " + shape_str(weight.shape()) +
                                " weight of rank " + std::to_string(layer.rank) + " adapters");
  const Tensor a_cast = a.to(weight.dtype()).to(weight.device()).contiguous();
  const Tensor b_cast = b.to(weight.dtype()).to(weight.device()).contiguous();
  return start_of(weight, a_cast, b_cast, layer);
}

}  // namespace quanta::quant
