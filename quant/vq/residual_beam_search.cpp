#include "quant/vq/residual_beam_search.h"

#include <string>
#include <utility>

#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/join.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "quant/residual.h"
#include "quant/vq/top_codes.h"

namespace quanta::quant {
namespace {

// [M, J, rest...] -> [M, J * k, rest...]: every path repeated for its k
// extensions.
Tensor widen(const Tensor& t, int64_t k) {
  Shape grown = t.shape();
  grown.insert(grown.begin() + 2, k);
  Shape merged = t.shape();
  merged[1] *= k;
  return reshape(expand(unsqueeze(t, 2), grown), merged);
}

// Paths `chosen` [M, L] of t [M, P, rest...] -> [M, L, rest...].
Tensor pick(const Tensor& t, const Tensor& chosen) {
  Tensor at = chosen;
  Shape shape = chosen.shape();
  for (int64_t i = 2; i < t.dim(); ++i) {
    at = unsqueeze(at, -1);
    shape.push_back(t.size(i));
  }
  return gather(t, 1, t.dim() > 2 ? expand(at, shape) : at);
}

// [B, N, k] or a scalar, as [M, J, k] for the folded [B, N * J] tokens.
Tensor per_path(const Tensor& v, int64_t m, int64_t j, int64_t k) {
  return v.dim() == 0 ? expand(reshape(v, {1, 1, 1}), {m, j, k}) : reshape(v, {m, j, k});
}

}  // namespace

QuantizeOutput residual_beam_search(const Tensor& tokens, const Tensor& keep,
                                    const std::vector<std::shared_ptr<VectorQuantize>>& layers,
                                    int64_t last_kept, const BeamSearch& search, bool training) {
  const int64_t b = tokens.size(0), n = tokens.size(1), d = tokens.size(2), m = b * n;
  const int64_t q_count = static_cast<int64_t>(layers.size());
  const int64_t last = last_kept >= 0 && last_kept < q_count ? last_kept : q_count - 1;
  const TensorOptions i64{.dtype = DType::i64, .device = tokens.device()};
  const Tensor zero_loss = zeros({}, options_of(tokens));
  // The paths: residual, summed output and score [M, J(, d)], and per layer
  // its code, loss, commitment [M, J] and input residual [M, J, d].
  Tensor residual = reshape(tokens, {m, 1, d});
  Tensor summed = zeros_like(residual);
  Tensor score = zeros({m, 1}, options_of(tokens));
  std::vector<Tensor> codes, losses, commits, inputs;
  MemberTerms scalar_terms;  // the layers' batch terms (orthogonal, diversity)
  for (int64_t i = 0; i <= last; ++i) {
    const int64_t j = residual.size(1);
    inputs.push_back(residual);
    Tensor mask;
    if (keep.defined()) mask = reshape(expand(unsqueeze(keep, -1), {b, n, j}), {b, n * j});
    const QuantizeOutput o =
        layers[size_t(i)]->forward_topk(reshape(residual, {b, n * j, d}), search.beam, mask);
    const int64_t k = o.indices.size(-1);
    const Tensor q = reshape(o.quantized, {m, j, k, d});
    score = reshape(unsqueeze(score, -1) - per_path(o.loss, m, j, k) * search.weights[size_t(i)],
                    {m, j * k});
    residual = reshape(unsqueeze(residual, 2) - frac_gradient(q, search.grad_frac), {m, j * k, d});
    summed = reshape(unsqueeze(summed, 2) + q, {m, j * k, d});
    for (auto* list : {&codes, &losses, &commits, &inputs})
      for (Tensor& t : *list) t = widen(t, k);
    codes.push_back(reshape(o.indices, {m, j * k}));
    losses.push_back(reshape(per_path(o.loss, m, j, k), {m, j * k}));
    commits.push_back(reshape(per_path(o.term("commitment"), m, j, k), {m, j * k}));
    for (const auto& [name, t] : o.losses)
      if (name != "commitment") {
        if (i == 0) scalar_terms.emplace_back(name, std::vector<Tensor>{});
        for (auto& [have, values] : scalar_terms)
          if (have == name) values.push_back(t);
      }
    const int64_t survivors = i == last ? 1 : search.beam;
    if (j * k > survivors) {
      const Tensor chosen = top_indices(score, survivors);
      score = pick(score, chosen);
      residual = pick(residual, chosen);
      summed = pick(summed, chosen);
      for (auto* list : {&codes, &losses, &commits, &inputs})
        for (Tensor& t : *list) t = pick(t, chosen);
    }
  }
  // The best path (the first: paths are ordered best first).
  const auto best = [&](const Tensor& t) { return select(t, 1, 0); };
  const Tensor count = keep.defined() ? clamp(sum(to_dtype(keep, tokens.dtype())), 1e-4, 1e300)
                                      : shared_full({}, double(m), options_of(tokens));
  const auto token_mean = [&](const Tensor& per_token) { return sum(best(per_token)) / count; };
  std::vector<Tensor> indices, layer_losses;
  MemberTerms terms{{"commitment", {}}};
  for (auto& [name, values] : scalar_terms) terms.emplace_back(name, std::vector<Tensor>{});
  for (int64_t i = 0; i < q_count; ++i) {
    const bool ran = i <= last;
    Tensor idx = ran ? reshape(best(codes[size_t(i)]), {b, n}) : full({b, n}, -1.0, i64);
    indices.push_back(idx);
    layer_losses.push_back(ran ? token_mean(losses[size_t(i)]) : zero_loss);
    terms[0].second.push_back(ran ? token_mean(commits[size_t(i)]) : zero_loss);
    for (size_t t = 0; t < scalar_terms.size(); ++t)
      terms[t + 1].second.push_back(ran ? scalar_terms[t].second[size_t(i)] : zero_loss);
    if (training && ran)
      layers[size_t(i)]->update_indices(reshape(best(inputs[size_t(i)]), {b, n, d}), idx, keep);
  }
  QuantizeOutput out;
  out.quantized = reshape(best(summed), {b, n, d});
  out.indices = stack(indices, -1);
  combine_member_losses(out, layer_losses, terms, MemberLosses::stacked, zero_loss);
  return out;
}

}  // namespace quanta::quant
