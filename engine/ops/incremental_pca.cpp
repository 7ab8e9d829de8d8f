#include "engine/ops/incremental_pca.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/ops/host_decomposition.h"
#include "engine/ops/svd.h"

namespace quanta {

IncrementalPCA::IncrementalPCA(int64_t components, int64_t lowrank_niter,
                               std::optional<Generator> sketch)
    : k_(components), niter_(lowrank_niter), sketch_(std::move(sketch)) {
  if (components < 1)
    throw std::invalid_argument("[IncrementalPCA] components must be >= 1, got " +
                                std::to_string(components));
  if (niter_ >= 0 && !sketch_)
    throw std::invalid_argument("[IncrementalPCA] the randomized SVD needs a sketch generator");
}

struct IncrementalPCA::Update {
  std::vector<double> mean, var;
  double total_variance = 0;
  int64_t rows = 0;
  Tensor stacked;  // [m, features] f64: what the SVD decomposes
};

IncrementalPCA::Update IncrementalPCA::prepare(const Tensor& x) const {
  if (x.dim() != 2)
    throw std::invalid_argument("[IncrementalPCA] needs rows [n, features], got " +
                                std::to_string(x.dim()) + " dims");
  if (x.dtype() != DType::f32 && x.dtype() != DType::f64)
    throw std::invalid_argument(std::string("[IncrementalPCA] needs f32 or f64 rows, got ") +
                                dtype_name(x.dtype()));
  const int64_t n = x.size(0), d = x.size(1);
  if (fitted() && d != features_)
    throw std::invalid_argument("[IncrementalPCA] rows of " + std::to_string(d) +
                                " features after rows of " + std::to_string(features_));
  if (k_ > d)
    throw std::invalid_argument("[IncrementalPCA] " + std::to_string(k_) +
                                " components of rows with " + std::to_string(d) + " features");
  if (n < k_)
    throw std::invalid_argument("[IncrementalPCA] a batch of " + std::to_string(n) + " rows for " +
                                std::to_string(k_) + " components");
  NoGradGuard no_grad;
  const std::vector<double> rows = x.detach().to(Device::cpu()).to(DType::f64).to_vector<double>();
  host_decomposition::check_finite(rows, n, d, "IncrementalPCA");

  // The columns' running mean and variance (Chan, Golub and LeVeque's
  // update, scikit-learn's _incremental_mean_and_var).
  const auto D = std::size_t(d);
  std::vector<double> batch_sum(D, 0.0), batch_mean(D), batch_square(D, 0.0), batch_shift(D, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < D; ++j) batch_sum[j] += rows[std::size_t(i) * D + j];
  for (std::size_t j = 0; j < D; ++j) batch_mean[j] = batch_sum[j] / double(n);
  for (int64_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < D; ++j) {
      const double t = rows[std::size_t(i) * D + j] - batch_mean[j];
      batch_shift[j] += t;
      batch_square[j] += t * t;
    }
  const double total = double(seen_ + n);
  Update u;
  u.rows = n;
  u.mean.resize(D);
  u.var.resize(D);
  for (std::size_t j = 0; j < D; ++j) {
    const double batch_unnormalized = batch_square[j] - batch_shift[j] * batch_shift[j] / double(n);
    const double last_sum = fitted() ? mean_[j] * double(seen_) : 0.0;
    u.mean[j] = (last_sum + batch_sum[j]) / total;
    if (!fitted()) {
      u.var[j] = batch_unnormalized / total;
    } else {
      const double last_over_new = double(seen_) / double(n);
      const double gap = last_sum / last_over_new - batch_sum[j];
      u.var[j] =
          (var_[j] * double(seen_) + batch_unnormalized + last_over_new / total * gap * gap) /
          total;
    }
    u.total_variance += u.var[j] * total;
  }

  // What the SVD sees: the batch centred on its own mean, after the kept
  // components scaled by their singular values and a row that moves their
  // mean to the new one.
  const int64_t kept = fitted() ? k_ : 0;
  const int64_t m = kept + n + (fitted() ? 1 : 0);
  std::vector<double> stacked(std::size_t(m) * D);
  for (int64_t c = 0; c < kept; ++c)
    for (std::size_t j = 0; j < D; ++j)
      stacked[std::size_t(c) * D + j] =
          singular_values_[std::size_t(c)] * components_[std::size_t(c) * D + j];
  for (int64_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < D; ++j)
      stacked[std::size_t(kept + i) * D + j] = rows[std::size_t(i) * D + j] - batch_mean[j];
  if (fitted()) {
    const double factor = std::sqrt(double(seen_) / total * double(n));
    for (std::size_t j = 0; j < D; ++j)
      stacked[std::size_t(m - 1) * D + j] = factor * (mean_[j] - batch_mean[j]);
  }
  u.stacked = from_vector<double>(stacked, {m, d});
  return u;
}

void IncrementalPCA::finish(Update& u, const Tensor& vh_tensor, const Tensor& s_tensor) {
  const std::vector<double> vh = vh_tensor.to_vector<double>();
  const std::vector<double> s = s_tensor.to_vector<double>();
  const auto D = std::size_t(u.stacked.size(1));
  components_.assign(std::size_t(k_) * D, 0.0);
  singular_values_.assign(std::size_t(k_), 0.0);
  ratio_.assign(std::size_t(k_), 0.0);
  for (int64_t c = 0; c < k_; ++c) {
    // svd_flip on the right vectors: each row's entry of largest magnitude
    // positive (the first such entry where two are equal).
    const double* row = vh.data() + std::size_t(c) * D;
    std::size_t arg = 0;
    for (std::size_t j = 1; j < D; ++j)
      if (std::abs(row[j]) > std::abs(row[arg])) arg = j;
    const double sign = row[arg] < 0 ? -1.0 : 1.0;
    for (std::size_t j = 0; j < D; ++j) components_[std::size_t(c) * D + j] = sign * row[j];
    const double sv = s[std::size_t(c)];
    singular_values_[std::size_t(c)] = sv;
    ratio_[std::size_t(c)] = u.total_variance > 0 ? sv * sv / u.total_variance : 0.0;
  }
  mean_ = std::move(u.mean);
  var_ = std::move(u.var);
  features_ = int64_t(D);
  seen_ += u.rows;
}

void IncrementalPCA::partial_fit(const Tensor& x) { partial_fit_all({this}, {x}); }

void IncrementalPCA::partial_fit_all(const std::vector<IncrementalPCA*>& pcas,
                                     const std::vector<Tensor>& rows) {
  if (pcas.size() != rows.size())
    throw std::invalid_argument("[IncrementalPCA] " + std::to_string(pcas.size()) + " fits and " +
                                std::to_string(rows.size()) + " batches");
  if (pcas.empty()) return;
  const int64_t niter = pcas[0]->niter_;
  for (std::size_t i = 0; i < pcas.size(); ++i) {
    if (pcas[i]->niter_ != niter)
      throw std::invalid_argument("[IncrementalPCA] fits with different SVDs (niter " +
                                  std::to_string(niter) + " and " +
                                  std::to_string(pcas[i]->niter_) + ")");
    for (std::size_t j = 0; j < i; ++j)
      if (pcas[j] == pcas[i]) throw std::invalid_argument("[IncrementalPCA] a fit given twice");
  }
  std::vector<Update> updates;
  std::vector<Tensor> matrices;
  std::vector<int64_t> k;
  for (std::size_t i = 0; i < pcas.size(); ++i) {
    updates.push_back(pcas[i]->prepare(rows[i]));
    const int64_t m = updates.back().stacked.size(0), d = updates.back().stacked.size(1);
    matrices.push_back(updates.back().stacked);
    // torch.svd_lowrank's q: twice the components kept.
    k.push_back(niter < 0 ? pcas[i]->k_ : std::min({2 * pcas[i]->k_, m, d}));
  }
  std::vector<SingularTriplets> t;
  if (niter < 0) {
    t = top_singular_triplets(matrices, k);
  } else {
    // Every update of a fit sketches from the same state: the same sketch
    // while its shape is, as PEFT's reseeding before each update gives.
    // Fresh draws would add their own error to the components'
    // differences from one update to the next, which decide convergence.
    std::vector<Generator> gens;
    for (IncrementalPCA* p : pcas) gens.push_back(*p->sketch_);
    t = approximate_singular_triplets(matrices, k, niter, gens);
  }
  for (std::size_t i = 0; i < pcas.size(); ++i) pcas[i]->finish(updates[i], t[i].vh, t[i].s);
}

Tensor IncrementalPCA::components() const {
  return from_vector<double>(components_, {fitted() ? k_ : 0, features_});
}
Tensor IncrementalPCA::singular_values() const {
  return from_vector<double>(singular_values_, {int64_t(singular_values_.size())});
}
Tensor IncrementalPCA::explained_variance_ratio() const {
  return from_vector<double>(ratio_, {int64_t(ratio_.size())});
}
Tensor IncrementalPCA::mean() const { return from_vector<double>(mean_, {features_}); }
Tensor IncrementalPCA::var() const { return from_vector<double>(var_, {features_}); }

}  // namespace quanta
