// evaluate_windows: batches of windows through the model, one loss per window.
#include "llm/model/lm_eval.h"

#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/ops/view.h"
#include "llm/model/lm_loss.h"

namespace quanta::llm {

namespace {

// read(begin, n): ids [begin, begin + n) of `count`, checked against the
// vocabulary.
using ReadIds = std::function<std::vector<int64_t>(int64_t, int64_t)>;

WindowEval windows(CausalLM& model, int64_t count, const std::string& source, const ReadIds& read,
                   int64_t seq_len, int64_t batch_size) {
  const DecoderConfig& c = model.config();
  if (seq_len < 2 || seq_len > c.max_position_embeddings)
    throw std::invalid_argument("seq_len must be in [2, max_position_embeddings " +
                                std::to_string(c.max_position_embeddings) + "], got " +
                                std::to_string(seq_len));
  if (batch_size < 1) throw std::invalid_argument("batch_size must be >= 1");
  WindowEval r;
  r.windows = count / seq_len;
  if (r.windows == 0)
    throw std::invalid_argument(source + ": " + std::to_string(count) +
                                " tokens hold no window of " + std::to_string(seq_len));
  NoGradGuard no_grad;
  EvalModeGuard eval_mode(model);  // no dropout (adapters) while scoring
  double total = 0;
  for (int64_t w0 = 0; w0 < r.windows; w0 += batch_size) {
    const int64_t n = std::min(batch_size, r.windows - w0);
    const std::vector<int64_t> ids = read(w0 * seq_len, n * seq_len);
    const Tensor batch = from_vector<int64_t>(ids, {n, seq_len});
    const Tensor logits = model.logits(batch.to(model.device()));
    // One loss per window: each row alone, as transformers scores a window.
    for (int64_t i = 0; i < n; ++i)
      total += causal_lm_loss(narrow(logits, 0, i, 1), narrow(batch, 0, i, 1))
                   .to(DType::f64)
                   .to_vector<double>()[0];
  }
  r.loss = total / static_cast<double>(r.windows);
  r.perplexity = std::exp(r.loss);
  r.tokens = r.windows * (seq_len - 1);
  return r;
}

}  // namespace

WindowEval evaluate_windows(CausalLM& model, const TokenFile& tokens, int64_t seq_len,
                            int64_t batch_size) {
  const int64_t vocab = model.config().vocab_size;
  return windows(
      model, tokens.size(), tokens.path(),
      [&](int64_t begin, int64_t n) { return tokens.read(begin, n, vocab); }, seq_len, batch_size);
}

WindowEval evaluate_windows(CausalLM& model, const std::vector<int64_t>& ids,
                            const std::string& source, int64_t seq_len, int64_t batch_size) {
  const int64_t vocab = model.config().vocab_size;
  return windows(
      model, static_cast<int64_t>(ids.size()), source,
      [&](int64_t begin, int64_t n) {
        std::vector<int64_t> out(ids.begin() + begin, ids.begin() + begin + n);
        for (int64_t i = 0; i < n; ++i)
          if (out[i] < 0 || out[i] >= vocab)
            throw std::invalid_argument(source + ": token " + std::to_string(begin + i) +
                                        " is id " + std::to_string(out[i]) +
                                        ", outside the model's vocabulary of " +
                                        std::to_string(vocab));
        return out;
      },
      seq_len, batch_size);
}

}  // namespace quanta::llm
