#include "quant/vq/kmeans.h"

#include <stdexcept>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "engine/random/sampling.h"
#include "quant/vq/code_statistics.h"
#include "quant/vq/nearest_code.h"

namespace quanta::quant {

Tensor sample_row_positions(int64_t n, int64_t m, Generator& gen, Device device) {
  if (n <= 0) throw std::invalid_argument("[sample_rows] no rows to sample from");
  const TensorOptions opts{.dtype = DType::i64, .device = device};
  return n >= m ? randperm_prefix(n, m, gen, opts) : randint(0, n, {m}, gen, opts);
}

Tensor sample_rows(const Tensor& rows, int64_t m, Generator& gen) {
  return index_select(rows, 0, sample_row_positions(rows.size(0), m, gen, rows.device()));
}

KMeansResult kmeans(const Tensor& samples, int64_t k, int64_t iters, bool cosine, Generator& gen) {
  NoGradGuard no_grad;
  const Tensor x = samples.detach();
  if (x.dim() != 2 || x.size(0) == 0)
    throw std::invalid_argument("[kmeans] needs samples [N, D] with N > 0, got " +
                                shape_str(x.shape()));
  Tensor means = sample_rows(x, k, gen);
  Tensor bins = zeros({k}, options_of(x));
  for (int64_t it = 0; it < iters; ++it) {
    const Tensor idx = nearest_codes(x, means, cosine);
    CodeStatistics st = code_statistics(idx, x, k);
    bins = st.counts;
    Tensor updated = st.sums / unsqueeze(clamp(bins, 1.0, std::nan("")), 1);
    if (cosine) updated = l2norm(updated);
    means = where(unsqueeze(eq(bins, constant_like(bins, 0.0)), 1), means, updated);
  }
  // No iteration: the sampled rows are the means, and the bins count the
  // rows nearest to each (all-zero bins would start the codebook's EMA
  // cluster sizes at 0, and its codes at embed_avg / 0).
  if (iters == 0) bins = code_statistics(nearest_codes(x, means, cosine), x, k).counts;
  return {means, bins};
}

double kmeans_distortion(const Tensor& samples, const Tensor& means, bool cosine) {
  NoGradGuard no_grad;
  if (samples.size(0) == 0) return 0.0;
  const Tensor idx = nearest_codes(samples, means, cosine);
  const Tensor diff = samples.detach() - index_select(means.detach(), 0, idx);
  return mean(diff * diff).item() * static_cast<double>(samples.size(1));
}

}  // namespace quanta::quant
