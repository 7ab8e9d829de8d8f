#include "train/metrics.h"

#include <cmath>
#include <limits>
#include <stdexcept>

#include "engine/autograd/grad_mode.h"
#include "engine/ops/loss.h"

namespace quanta::train {

CodeCounts::CodeCounts(int64_t size, int64_t num_codebooks)
    : codebook_size(size),
      counts(size > 0 ? static_cast<size_t>(num_codebooks) : 0,
             std::vector<int64_t>(static_cast<size_t>(std::max<int64_t>(size, 0)), 0)) {}

void CodeCounts::add(const std::vector<Tensor>& codes) {
  if (counts.empty()) return;
  if (codes.size() != counts.size())
    throw std::invalid_argument("[metrics] codes of " + std::to_string(codes.size()) +
                                " codebooks for counts of " + std::to_string(counts.size()));
  for (size_t q = 0; q < codes.size(); ++q) {
    if (codes[q].numel() == 0) continue;
    for (int64_t v : codes[q].to_vector<int64_t>()) {
      if (v < 0 || v >= codebook_size)
        throw std::invalid_argument("[metrics] code index " + std::to_string(v) +
                                    " outside the codebook of " + std::to_string(codebook_size));
      ++counts[q][static_cast<size_t>(v)];
    }
  }
}

namespace {

double mean(const std::vector<double>& v) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  double sum = 0;
  for (double x : v) sum += x;
  return sum / static_cast<double>(v.size());
}

double used_fraction(const std::vector<int64_t>& c) {
  int64_t used = 0;
  for (int64_t n : c) used += n > 0;
  return static_cast<double>(used) / static_cast<double>(c.size());
}

// exp(entropy) of the frequencies; NaN when nothing was counted.
double effective_codes(const std::vector<int64_t>& c) {
  double total = 0;
  for (int64_t n : c) total += static_cast<double>(n);
  if (total == 0) return std::numeric_limits<double>::quiet_NaN();
  double entropy = 0;
  for (int64_t n : c)
    if (n > 0) {
      const double p = static_cast<double>(n) / total;
      entropy -= p * std::log(p);
    }
  return std::exp(entropy);
}

}  // namespace

double CodeCounts::usage() const { return mean(usage_per_codebook()); }

double CodeCounts::perplexity() const { return mean(perplexity_per_codebook()); }

std::vector<double> CodeCounts::usage_per_codebook() const {
  std::vector<double> u;
  for (const auto& c : counts) u.push_back(used_fraction(c));
  return u;
}

std::vector<double> CodeCounts::perplexity_per_codebook() const {
  std::vector<double> p;
  for (const auto& c : counts) p.push_back(effective_codes(c));
  return p;
}

std::vector<double> CodeCounts::totals() const {
  std::vector<double> t(static_cast<size_t>(std::max<int64_t>(codebook_size, 0)), 0.0);
  for (const auto& c : counts)
    for (size_t k = 0; k < c.size(); ++k) t[k] += static_cast<double>(c[k]);
  return counts.empty() ? std::vector<double>{} : t;
}

double psnr_db(double mse, double peak) {
  if (!(mse >= 0)) return std::numeric_limits<double>::quiet_NaN();
  if (mse == 0) return std::numeric_limits<double>::infinity();
  return 10.0 * std::log10(peak * peak / mse);
}

EvalResult evaluate(VqVae& model, const Tensor& images, int64_t batch_size) {
  if (batch_size <= 0) throw std::invalid_argument("[evaluate] batch_size must be positive");
  EvalModeGuard eval_mode(model);
  NoGradGuard no_grad;
  CodeCounts counts(model.quantizer().codebook_size(), model.quantizer().num_codebooks());
  const int64_t n = images.size(0);
  const Device device = model.parameters().front().device();
  double squared = 0;
  for (int64_t start = 0; start < n; start += batch_size) {
    const Tensor batch = images.narrow(0, start, std::min(batch_size, n - start)).to(device);
    VqVaeOutput out = model.run(batch);
    squared += mse_loss(out.reconstruction, batch, Reduction::sum).item();
    counts.add(model.quantizer().codes_per_codebook(out.quantized.indices));
  }
  EvalResult r;
  r.samples = n;
  r.mse = n > 0 ? squared / static_cast<double>(images.numel())
                : std::numeric_limits<double>::quiet_NaN();
  r.psnr = psnr_db(r.mse);
  r.usage = counts.usage();
  r.perplexity = counts.perplexity();
  r.code_totals = counts.totals();
  if (counts.counts.size() > 1) {
    const std::vector<double> usage = counts.usage_per_codebook();
    const std::vector<double> perplexity = counts.perplexity_per_codebook();
    for (size_t q = 0; q < counts.counts.size(); ++q)
      r.per_codebook.push_back(
          {model.quantizer().codebook_name(static_cast<int64_t>(q)), usage[q], perplexity[q],
           std::vector<double>(counts.counts[q].begin(), counts.counts[q].end())});
  }
  return r;
}

}  // namespace quanta::train
