// causal_lm_loss and its chunked form (a custom autograd function that
// recomputes each chunk's logits in the backward).
#include "llm/model/lm_loss.h"

#include <memory>
#include <stdexcept>

#include "engine/autograd/function.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/join.h"
#include "engine/ops/linalg.h"
#include "engine/ops/loss.h"
#include "engine/ops/reductions.h"
#include "engine/ops/softmax.h"
#include "engine/ops/view.h"

namespace quanta::llm {
namespace {

void check_labels(const char* op, const Tensor& labels, int64_t B, int64_t T) {
  if (!labels.defined() || labels.dtype() != DType::i64 || labels.dim() != 2 ||
      labels.size(0) != B || labels.size(1) != T)
    throw std::invalid_argument(
        std::string("[") + op + "] labels must be i64 [" + std::to_string(B) + ", " +
        std::to_string(T) + "]" +
        (labels.defined()
             ? ", got " + std::string(dtype_name(labels.dtype())) + " " + shape_str(labels.shape())
             : std::string()));
}

// transformers upcasts logits to f32; f64 stays f64.
DType loss_dtype(DType logits) { return logits == DType::f64 ? DType::f64 : DType::f32; }

// labels[:, 1:] flattened: the next token of each predicting position.
Tensor next_labels(const Tensor& labels) {
  const int64_t B = labels.size(0), T = labels.size(1);
  return reshape(contiguous(slice(labels, 1, 1, T)), {B * (T - 1)});
}

}  // namespace

Tensor causal_lm_loss(const Tensor& logits, const Tensor& labels, int64_t ignore_index) {
  if (!logits.defined() || logits.dim() != 3)
    throw std::invalid_argument("[causal_lm_loss] logits must be [batch, tokens, vocab]");
  const int64_t B = logits.size(0), T = logits.size(1), V = logits.size(2);
  check_labels("causal_lm_loss", labels, B, T);
  if (T < 2) throw std::invalid_argument("[causal_lm_loss] needs at least 2 tokens per row");
  // As transformers 5 does: the labels shift left and the last position of
  // each row gets ignore_index, so every row of the logits is used as it lies
  // (a view, not a copy of [batch, tokens - 1, vocab]).
  const Tensor l = labels.to(logits.device());
  const Tensor shifted = cat({slice(l, 1, 1, T), full({B, 1}, static_cast<double>(ignore_index),
                                                      {.dtype = DType::i64, .device = l.device()})},
                             1);
  const Tensor x = reshape(logits, {B * T, V}).to(loss_dtype(logits.dtype()));
  return cross_entropy(x, reshape(shifted, {B * T}), Reduction::mean, ignore_index);
}

Tensor chunked_causal_lm_loss(const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                              int64_t chunk_tokens, int64_t ignore_index) {
  constexpr const char* op = "chunked_causal_lm_loss";
  if (!hidden.defined() || hidden.dim() != 3)
    throw std::invalid_argument("[chunked_causal_lm_loss] hidden must be [batch, tokens, hidden]");
  const int64_t B = hidden.size(0), T = hidden.size(1), d = hidden.size(2);
  if (!weight.defined() || weight.dim() != 2 || weight.size(1) != d)
    throw std::invalid_argument("[chunked_causal_lm_loss] weight must be [vocab, " +
                                std::to_string(d) + "]");
  check_labels(op, labels, B, T);
  if (T < 2)
    throw std::invalid_argument("[chunked_causal_lm_loss] needs at least 2 tokens per row");
  if (chunk_tokens < 1)
    throw std::invalid_argument("[chunked_causal_lm_loss] chunk_tokens must be >= 1");
  const int64_t N = B * (T - 1);
  const Tensor targets = next_labels(labels.to(hidden.device()));
  const Tensor valid = ne(targets, full_like(targets, static_cast<double>(ignore_index)));
  // The number of counted labels stays on the device: no host sync.
  const DType acc = loss_dtype(weight.dtype());
  const Tensor count = sum(valid.to(acc));
  const auto rows = [=](const Tensor& h) {
    return reshape(contiguous(slice(h, 1, 0, T - 1)), {N, d});
  };
  autograd::Function fn;
  fn.name = op;
  fn.forward = [=](const std::vector<Tensor>& in) {
    const Tensor h = rows(in[0]);
    Tensor total = zeros({}, {.dtype = acc, .device = h.device()});
    for (int64_t n0 = 0; n0 < N; n0 += chunk_tokens) {
      const int64_t n = std::min(chunk_tokens, N - n0);
      const Tensor logits = linear(narrow(h, 0, n0, n), in[1]).to(acc);
      total = add(total,
                  cross_entropy(logits, narrow(targets, 0, n0, n), Reduction::sum, ignore_index));
    }
    return std::vector<Tensor>{div(total, count)};
  };
  const Tensor h_saved = hidden.detach(), w_saved = weight.detach();
  fn.backward = [=](const std::vector<Tensor>& g) {
    const Tensor h = rows(h_saved);
    const Tensor scale = div(g[0].to(acc), count);
    Tensor gh = empty({N, d}, {.dtype = h.dtype(), .device = h.device()});
    Tensor gw = zeros(w_saved.shape(), {.dtype = acc, .device = h.device()});
    const int64_t V = w_saved.size(0);
    for (int64_t n0 = 0; n0 < N; n0 += chunk_tokens) {
      const int64_t n = std::min(chunk_tokens, N - n0);
      const Tensor hc = narrow(h, 0, n0, n);
      const Tensor t = narrow(targets, 0, n0, n), ok = narrow(valid, 0, n0, n);
      const Tensor p = softmax(linear(hc, w_saved).to(acc), 1);
      const Tensor safe = where(ok, t, zeros_like(t));
      // d(loss)/d(logits) = (softmax - one_hot) on counted rows, times g / count.
      const Tensor dlogits =
          mul(mul(sub(p, one_hot(safe, V).to(acc)), unsqueeze(ok.to(acc), 1)), scale);
      const Tensor dl = dlogits.to(w_saved.dtype());
      copy_(narrow(gh, 0, n0, n), matmul(dl, w_saved));
      gw = add(gw, matmul(transpose(dlogits, 0, 1), hc.to(acc)));
    }
    Tensor gh_full = zeros(h_saved.shape(), {.dtype = h.dtype(), .device = h.device()});
    copy_(slice(gh_full, 1, 0, T - 1), reshape(gh, {B, T - 1, d}));
    return std::vector<Tensor>{gh_full, gw.to(w_saved.dtype())};
  };
  return autograd::apply(fn, {hidden, weight})[0];
}

}  // namespace quanta::llm
