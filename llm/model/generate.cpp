// generate(): the prompt through the model once, then one token at a time
// against the KV cache; the choice of each token on the host (one read of
// the last row of logits per token).
#include "llm/model/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/ops/view.h"
#include "engine/random/generator.h"
#include "engine/random/sampling.h"

namespace quanta::llm {
namespace {

int64_t pick(const std::vector<double>& logits, const GenerateOptions& o, Generator& gen) {
  const int64_t V = static_cast<int64_t>(logits.size());
  if (o.temperature == 0) {
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i)
      if (logits[i] > logits[best]) best = i;
    return best;
  }
  std::vector<double> p(logits.size());
  const double mx = *std::max_element(logits.begin(), logits.end());
  double z = 0;
  for (int64_t i = 0; i < V; ++i) z += p[i] = std::exp((logits[i] - mx) / o.temperature);
  for (double& v : p) v /= z;
  std::vector<int64_t> order(p.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
  int64_t keep = 0;
  double mass = 0;
  while (keep < V && (keep == 0 || mass < o.top_p)) mass += p[order[keep++]];
  const double u = rand({1}, gen, {.dtype = DType::f64}).to_vector<double>()[0] * mass;
  double acc = 0;
  for (int64_t k = 0; k < keep; ++k) {
    acc += p[order[k]];
    if (u < acc) return order[k];
  }
  return order[keep - 1];
}

}  // namespace

std::vector<int64_t> generate(CausalLM& model, const std::vector<int64_t>& prompt,
                              const GenerateOptions& o) {
  const DecoderConfig& c = model.config();
  if (prompt.empty()) throw std::invalid_argument("[generate] the prompt is empty");
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0 || prompt[i] >= c.vocab_size)
      throw std::invalid_argument("[generate] prompt id " + std::to_string(prompt[i]) +
                                  " at position " + std::to_string(i) + " is outside [0, " +
                                  std::to_string(c.vocab_size) + ")");
  if (o.max_new_tokens < 0) throw std::invalid_argument("[generate] max_new_tokens must be >= 0");
  if (!(o.temperature >= 0) || !std::isfinite(o.temperature))
    throw std::invalid_argument("[generate] temperature must be finite and >= 0");
  if (!(o.top_p > 0 && o.top_p <= 1))
    throw std::invalid_argument("[generate] top_p must be in (0, 1]");
  const int64_t total = static_cast<int64_t>(prompt.size()) + o.max_new_tokens;
  if (total > c.max_position_embeddings)
    throw std::invalid_argument("[generate] prompt + max_new_tokens = " + std::to_string(total) +
                                " exceeds max_position_embeddings " +
                                std::to_string(c.max_position_embeddings));
  NoGradGuard no_grad;
  EvalModeGuard eval_mode(model);  // no dropout (adapters) while generating
  Generator gen(o.seed);
  KVCache cache;
  std::vector<int64_t> out;
  Tensor ids = from_vector<int64_t>(prompt, {1, static_cast<int64_t>(prompt.size())});
  for (int64_t step = 0; step < o.max_new_tokens; ++step) {
    const Tensor logits = model.logits(ids, &cache);
    const Tensor last = select(select(logits, 0, 0), 0, logits.size(1) - 1);
    const int64_t next = pick(last.to(DType::f64).to_vector<double>(), o, gen);
    out.push_back(next);
    if (std::find(o.eos_token_ids.begin(), o.eos_token_ids.end(), next) != o.eos_token_ids.end())
      break;
    ids = from_vector<int64_t>({next}, {1, 1});
  }
  return out;
}

}  // namespace quanta::llm
