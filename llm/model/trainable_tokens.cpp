#include "llm/model/trainable_tokens.h"

#include <set>
#include <stdexcept>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/join.h"
#include "engine/ops/view.h"

namespace quanta::llm {

TrainableTokens::TrainableTokens(const Tensor& weight, std::vector<int64_t> indices)
    : Module("TrainableTokens"), indices_(std::move(indices)) {
  if (weight.dim() != 2)
    throw std::invalid_argument("[TrainableTokens] the weight must be 2-d [rows, dim], got " +
                                shape_str(weight.shape()));
  if (indices_.empty()) throw std::invalid_argument("[TrainableTokens] no token index given");
  std::set<int64_t> seen;
  for (int64_t i : indices_) {
    if (i < 0 || i >= weight.size(0))
      throw std::invalid_argument("[TrainableTokens] token index " + std::to_string(i) +
                                  " is outside the vocabulary of " +
                                  std::to_string(weight.size(0)));
    if (!seen.insert(i).second)
      throw std::invalid_argument("[TrainableTokens] token index " + std::to_string(i) +
                                  " is given twice");
  }
  const int64_t n = static_cast<int64_t>(indices_.size()), dim = weight.size(1);
  const Tensor rows = from_vector(indices_, {n}).to(weight.device());
  NoGradGuard no_grad;
  values_ = register_parameter("trainable_tokens_delta",
                               index_select(weight.detach(), 0, rows).contiguous());
  rows_ = register_buffer("token_rows", rows, /*persistent=*/false);
  index_ = register_buffer("token_index", expand(reshape(rows, {n, 1}), {n, dim}).contiguous(),
                           /*persistent=*/false);
  std::vector<int64_t> slot(static_cast<size_t>(weight.size(0)), n);
  for (int64_t i = 0; i < n; ++i) slot[static_cast<size_t>(indices_[i])] = i;
  slot_ = register_buffer("token_slot", from_vector(slot, {weight.size(0)}).to(weight.device()),
                          /*persistent=*/false);
}

Tensor TrainableTokens::apply(const Tensor& weight) const {
  return scatter(weight, 0, index_, values_.to(weight.dtype()));
}

Tensor TrainableTokens::lookup(const Tensor& weight, const Tensor& ids, int64_t padding_idx) const {
  const int64_t n = values_.size(0);
  const Tensor slots = reshape(index_select(slot_, 0, flatten(ids)), ids.shape());
  // The values and one row for the positions that read the weight instead.
  const Tensor table =
      cat({values_.to(weight.dtype()),
           zeros({1, values_.size(1)}, {.dtype = weight.dtype(), .device = weight.device()})});
  int64_t padding_slot = n;  // the filler row: its gradient is dropped anyway
  for (int64_t i = 0; i < n; ++i)
    if (indices_[static_cast<size_t>(i)] == padding_idx) padding_slot = i;
  const Tensor trained = embedding(table, slots, padding_slot);
  const Tensor kept = unsqueeze(lt(slots, full_like(slots, static_cast<double>(n))), -1);
  return where(kept, trained, embedding(weight, ids, padding_idx));
}

}  // namespace quanta::llm
