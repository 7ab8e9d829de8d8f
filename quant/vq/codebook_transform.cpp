#include "quant/vq/codebook_transform.h"

#include <stdexcept>
#include <string>

#include "engine/ops/elementwise.h"
#include "engine/ops/linalg.h"
#include "engine/ops/view.h"

namespace quanta::quant {

ImplicitCodebookMLP::ImplicitCodebookMLP(int64_t dim, int64_t dim_hidden, int64_t depth,
                                         Generator& gen)
    : Module("ImplicitCodebookMLP"), dim_(dim) {
  if (dim <= 0 || dim_hidden < 0 || depth < 0)
    throw std::invalid_argument(
        "[ImplicitCodebookMLP] dim must be positive and dim_hidden, depth " +
        std::string(">= 0: got ") + std::to_string(dim) + ", " + std::to_string(dim_hidden) + ", " +
        std::to_string(depth));
  const int64_t hidden = dim_hidden > 0 ? dim_hidden : dim;
  proj_in_ = register_module("proj_in", std::make_shared<Linear>(2 * dim, dim, gen));
  auto list = register_module("layers", std::make_shared<Module>("ModuleList"));
  for (int64_t i = 0; i < depth; ++i) {
    auto first = std::make_shared<Linear>(dim, hidden, gen);
    auto second = std::make_shared<Linear>(hidden, dim, gen);
    blocks_.push_back(list->register_module(
        std::to_string(i), std::make_shared<Sequential>(first, std::make_shared<SiLU>(), second)));
  }
}

Tensor ImplicitCodebookMLP::forward(const Tensor& codes, const Tensor& condition) {
  if (!condition.defined())
    throw std::invalid_argument(
        "[ImplicitCodebookMLP] needs a condition (the running quantized sum), got none");
  if (codes.dim() != 3 || codes.size(2) != dim_ || condition.dim() != 2 ||
      condition.size(1) != dim_)
    throw std::invalid_argument("[ImplicitCodebookMLP] expects codes [G, K, " +
                                std::to_string(dim_) + "] and a condition [T, " +
                                std::to_string(dim_) + "], got " + shape_str(codes.shape()) +
                                " and " + shape_str(condition.shape()));
  // proj_in of the concatenation [z, c] is W_z z + W_c c + b: the two halves
  // are formed apart and broadcast, so neither [G, T, K, 2d] copy is made.
  const Tensor& w = proj_in_->weight();
  const Tensor from_condition = linear(condition, slice(w, 1, 0, dim_));  // [T, d]
  const Tensor from_codes =
      linear(codes, slice(w, 1, dim_, 2 * dim_), proj_in_->bias());                  // [G, K, d]
  Tensor x = unsqueeze(unsqueeze(from_condition, 0), 2) + unsqueeze(from_codes, 1);  // [G, T, K, d]
  for (const auto& block : blocks_) x = block->forward(x) + x;
  return x;
}

}  // namespace quanta::quant
