// causal_lm_loss and its chunked form (a custom autograd function that
// forms each chunk's gradients while its logits are alive).
#include "llm/model/lm_loss.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "engine/autograd/function.h"
#include "engine/autograd/grad_mode.h"
#include "engine/autograd/node.h"
#include "engine/device_backend.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/join.h"
#include "engine/ops/linalg.h"
#include "engine/ops/loss.h"
#include "engine/ops/reductions.h"
#include "engine/ops/view.h"
#include "llm/kernels/table.h"

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

// Targets each ignore_index or in [0, vocab), as cross_entropy checks them:
// on the CPU at once, naming the bad one; on a device by the device,
// reported at the next read (a bad target then reads as class 0).
Tensor checked_targets(const Tensor& targets, int64_t vocab, int64_t ignore_index) {
  if (device_caps(targets.device()).host_readable) {
    for (int64_t v : targets.to_vector<int64_t>())
      if (v != ignore_index && (v < 0 || v >= vocab))
        throw std::invalid_argument("[chunked_causal_lm_loss] target " + std::to_string(v) +
                                    " is out of range for a vocabulary of " +
                                    std::to_string(vocab) + " (ignore_index " +
                                    std::to_string(ignore_index) + ")");
    return targets;
  }
  // The constants are shared: no fill a step.
  const TensorOptions opts{.dtype = DType::i64, .device = targets.device()};
  const Tensor ignored = eq(targets, shared_full({}, static_cast<double>(ignore_index), opts));
  const Tensor checked = quanta::detail::checked_index(
      "chunked_causal_lm_loss", contiguous(where(ignored, shared_full({}, 0.0, opts), targets)), 0,
      vocab);
  return where(ignored, targets, checked);
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

int64_t loss_chunk_tokens(int64_t vocab) {
  const int64_t rows = kLossChunkBytes / (int64_t{4} * std::max<int64_t>(vocab, 1));
  return std::max<int64_t>(64, rows / 64 * 64);
}

Tensor softcap_logits(const Tensor& logits, double cap) {
  if (cap == 0) return logits;
  if (!(cap > 0) || !std::isfinite(cap))
    throw std::invalid_argument("[softcap_logits] the cap must be finite and > 0 (0: none), got " +
                                std::to_string(cap));
  return tanh(logits / cap) * cap;
}

Tensor scale_logits(const Tensor& logits, double divisor) {
  if (divisor == 1) return logits;
  if (!(divisor > 0) || !std::isfinite(divisor))
    throw std::invalid_argument(
        "[scale_logits] the divisor must be finite and > 0 (1: none), got " +
        std::to_string(divisor));
  const DType dt = logits.dtype();
  if (dt == DType::f32 || dt == DType::f64) return logits / divisor;
  return (logits.to(DType::f32) / divisor).to(dt);
}

Tensor chunked_causal_lm_loss(const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                              const LmLossOptions& options) {
  constexpr const char* op = "chunked_causal_lm_loss";
  int64_t chunk_tokens = options.chunk_tokens;
  const int64_t ignore_index = options.ignore_index;
  const Tensor &trained_rows = options.trained_rows, &trained_values = options.trained_values;
  const double cap = options.logit_softcap, divisor = options.logit_divisor;
  if (!(cap >= 0) || !std::isfinite(cap))
    throw std::invalid_argument(
        "[chunked_causal_lm_loss] logit_softcap must be finite and >= 0 (0: none), got " +
        std::to_string(cap));
  if (!(divisor > 0) || !std::isfinite(divisor))
    throw std::invalid_argument(
        "[chunked_causal_lm_loss] logit_divisor must be finite and > 0 (1: none), got " +
        std::to_string(divisor));
  if (!hidden.defined() || hidden.dim() != 3)
    throw std::invalid_argument("[chunked_causal_lm_loss] hidden must be [batch, tokens, hidden]");
  const int64_t B = hidden.size(0), T = hidden.size(1), d = hidden.size(2);
  if (!weight.defined() || weight.dim() != 2 || weight.size(1) != d)
    throw std::invalid_argument("[chunked_causal_lm_loss] weight must be [vocab, " +
                                std::to_string(d) + "]");
  check_labels(op, labels, B, T);
  if (T < 2)
    throw std::invalid_argument("[chunked_causal_lm_loss] needs at least 2 tokens per row");
  if (chunk_tokens < 0)
    throw std::invalid_argument("[chunked_causal_lm_loss] chunk_tokens must be >= 0 (0: " +
                                std::string("automatic), got ") + std::to_string(chunk_tokens));
  const int64_t N = B * (T - 1), V = weight.size(0);
  if (trained_rows.defined() != trained_values.defined())
    throw std::invalid_argument(
        "[chunked_causal_lm_loss] trained_rows and trained_values go together");
  if (trained_rows.defined() && (trained_rows.dtype() != DType::i64 || trained_rows.dim() != 1))
    throw std::invalid_argument("[chunked_causal_lm_loss] trained_rows must be 1-d i64, got " +
                                std::string(dtype_name(trained_rows.dtype())) + " " +
                                shape_str(trained_rows.shape()));
  if (trained_values.defined() &&
      (trained_values.dim() != 2 || trained_values.size(0) != trained_rows.numel() ||
       trained_values.size(1) != d))
    throw std::invalid_argument("[chunked_causal_lm_loss] trained_values must be [" +
                                std::to_string(trained_rows.numel()) + ", " + std::to_string(d) +
                                "] (one row per trained row), got " +
                                shape_str(trained_values.shape()));
  // With trained rows the weight is a constant the forward alone reads.
  const bool rows_train = trained_values.defined();
  const Tensor trained = rows_train ? trained_values : weight;
  auto held_weight = std::make_shared<Tensor>(rows_train ? weight.detach() : Tensor());
  if (chunk_tokens == 0) chunk_tokens = loss_chunk_tokens(V);
  const Tensor targets = checked_targets(next_labels(labels.to(hidden.device())), V, ignore_index);
  const Tensor valid =
      ne(targets, shared_full({}, static_cast<double>(ignore_index), options_of(targets)));
  // The number of counted labels stays on the device: no host sync.
  const DType acc = loss_dtype(weight.dtype());
  const Tensor count = sum(valid.to(acc));
  const auto rows = [=](const Tensor& h) {
    return reshape(contiguous(slice(h, 1, 0, T - 1)), {N, d});
  };
  // When the loss will be differentiated, each chunk's gradients are formed
  // while its logits are alive (d loss / d logits = softmax - one_hot), so
  // the backward only scales them: the logits are computed once, and the
  // weight's gradient only when the weight is trained (a frozen lm_head, as
  // in QLoRA, costs one GEMM fewer per chunk).
  const bool differentiated = grad_enabled() && (hidden.requires_grad() || trained.requires_grad());
  const bool weight_grad = differentiated && trained.requires_grad();
  const bool hidden_grad = differentiated && hidden.requires_grad();
  // Unscaled gradients ([N, hidden] and [vocab, hidden] in the accumulation
  // dtype), filled by the forward and read once by the backward.
  auto grads = std::make_shared<std::vector<Tensor>>(2);
  autograd::Function fn;
  fn.name = op;
  fn.forward = [=](const std::vector<Tensor>& in) {
    const Tensor h = rows(in[0]);
    const Tensor w = rows_train ? *held_weight : in[1];
    if (!w.defined()) throw std::logic_error("[chunked_causal_lm_loss] forward ran twice");
    *held_weight = Tensor();  // a trained-rows weight is not needed past here
    // The loss summed chunk by chunk (the first chunk's sum is the start);
    // the hidden gradient written chunk by chunk, or one chunk's product as
    // it is.
    Tensor total;
    const bool one_chunk = N <= chunk_tokens;
    Tensor gh =
        hidden_grad && !one_chunk ? empty({N, d}, {.dtype = acc, .device = h.device()}) : Tensor();
    // The weight's gradient: whole, or of the trained rows alone.
    const Tensor rows_at = trained_rows.defined() ? trained_rows.to(h.device()) : Tensor();
    Tensor gw = !weight_grad ? Tensor()
                : rows_at.defined()
                    ? zeros({rows_at.numel(), d}, {.dtype = acc, .device = h.device()})
                    : zeros(w.shape(), {.dtype = acc, .device = h.device()});
    for (int64_t n0 = 0; n0 < N; n0 += chunk_tokens) {
      const int64_t n = std::min(chunk_tokens, N - n0);
      const Tensor hc = narrow(h, 0, n0, n);
      const Tensor t = contiguous(narrow(targets, 0, n0, n));
      // The chunk's logits, this loop's own: the kernel turns them into
      // their gradient (softmax less 1 at the target, ignored rows zero) in
      // place, one pass, while it sums each row's loss. Soft-capped, the
      // gradient is then taken through the cap: times 1 - tanh^2 (and
      // through a divisor: over it).
      Tensor dlogits, cap_tanh;
      Tensor logits = scale_logits(linear(hc, w), divisor);
      if (cap > 0) {
        cap_tanh = tanh(logits / cap);
        dlogits = (cap_tanh * cap).to(acc).contiguous();
      } else {
        dlogits = logits.to(acc).contiguous();
      }
      logits = Tensor();  // when dlogits is the same tensor, it is now its sole holder
      if (!autograd::sole_storage(dlogits)) dlogits = dlogits.clone();
      const Tensor row_loss = empty({n}, {.dtype = acc, .device = h.device()});
      llm_kernels(h.device())
          .lm_loss_rows(acc, dlogits.raw_data(), static_cast<const int64_t*>(t.raw_data()), n, V,
                        ignore_index, differentiated, row_loss.raw_data());
      total = total.defined() ? add(total, sum(row_loss)) : sum(row_loss);
      if (!differentiated) continue;
      if (cap > 0) {
        const Tensor t = cap_tanh.to(acc);
        dlogits = dlogits * (1.0 - t * t);
      }
      if (divisor != 1) dlogits = dlogits / divisor;
      if (hidden_grad) {
        Tensor product = matmul(dlogits.to(w.dtype()), w);
        if (one_chunk)
          gh = std::move(product);
        else
          copy_(narrow(gh, 0, n0, n), product);
      }
      if (weight_grad) {
        const Tensor columns = rows_at.defined() ? index_select(dlogits, 1, rows_at) : dlogits;
        gw = add(gw, matmul(transpose(columns, 0, 1), hc.to(acc)));
      }
    }
    if (!total.defined()) total = zeros({}, {.dtype = acc, .device = h.device()});  // no rows
    if (hidden_grad && !gh.defined()) gh = empty({N, d}, {.dtype = acc, .device = h.device()});
    *grads = {gh, gw};
    return std::vector<Tensor>{div(total, count)};
  };
  const Shape hidden_shape = hidden.shape();
  const DType hidden_dtype = hidden.dtype(), weight_dtype = weight.dtype(),
              trained_dtype = trained.dtype();
  fn.backward = [=](const std::vector<Tensor>& g) {
    const Tensor scale = div(g[0].to(acc), count);
    std::vector<Tensor> out(2);
    const Tensor gh = (*grads)[0], gw = (*grads)[1];
    grads->assign(2, Tensor());  // read once: a second backward finds nothing
    if (hidden_grad) {
      if (!gh.defined())
        throw std::runtime_error("[chunked_causal_lm_loss] backward ran twice on one loss");
      // The last position of each row predicts nothing: its rows are a
      // shared zero piece of the one copy that joins them.
      const Tensor last =
          shared_full({B, 1, d}, 0.0, {.dtype = hidden_dtype, .device = gh.device()});
      out[0] = cat({reshape(mul(gh, scale).to(hidden_dtype), {B, T - 1, d}), last}, 1);
    }
    if (weight_grad) {
      if (!gw.defined())
        throw std::runtime_error("[chunked_causal_lm_loss] backward ran twice on one loss");
      out[1] = mul(gw, scale).to(rows_train ? trained_dtype : weight_dtype);
    }
    return out;
  };
  return autograd::apply(fn, {hidden, trained})[0];
}

}  // namespace quanta::llm
