#include "quant/vq/top_codes.h"

#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/autograd/grad_mode.h"
#include "engine/ops/index.h"
#include "engine/ops/join.h"
#include "engine/ops/reductions.h"
#include "engine/ops/view.h"

namespace quanta::quant {

Tensor top_indices(const Tensor& x, int64_t k, bool largest) {
  if (x.dim() < 1 || k < 1 || k > x.size(-1))
    throw std::invalid_argument(
        "[top_indices] k must be in [1, " + std::to_string(x.dim() < 1 ? 0 : x.size(-1)) +
        "] for a tensor of shape " + shape_str(x.shape()) + ", got " + std::to_string(k));
  NoGradGuard no_grad;
  Tensor rest = x.detach();
  std::vector<Tensor> picks;
  for (int64_t i = 0; i < k; ++i) {
    const Tensor best = largest ? argmax(rest, -1, true) : argmin(rest, -1, true);
    picks.push_back(best);
    const double taken = std::numeric_limits<double>::infinity();
    if (i + 1 < k) rest = scatter(rest, -1, best, largest ? -taken : taken);
  }
  return k == 1 ? picks[0] : cat(picks, -1);
}

}  // namespace quanta::quant
