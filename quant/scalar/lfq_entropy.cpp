#include "quant/scalar/lfq_entropy.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "engine/autograd/function.h"
#include "engine/cpu/parallel.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/join.h"
#include "engine/ops/linalg.h"
#include "engine/ops/reduce.h"
#include "engine/ops/softmax.h"
#include "engine/ops/view.h"

namespace quanta::quant {
namespace {

// The walk over K = {codes with p >= eps} of one token (see the header).
// Codes are the most likely code with a set S of bits flipped; children of a
// node flip one more bit, later in |z| order than every bit already in S, so
// each code is visited once, and a child is in K only if its parent is.
class ClampedEntropyWalk {
 public:
  explicit ClampedEntropyWalk(int64_t d) : d_(d), a_(d), e_(d), order_(d), flip_weight_(d) {}

  // Entropy of the token with bit logits z[0..d); writes dH/dz to grad.
  double run(const double* z, double* grad) {
    double log_best = 0;
    for (int64_t j = 0; j < d_; ++j) {
      a_[j] = std::abs(z[j]);
      e_[j] = std::exp(-a_[j]);       // p(flipped bit) / p(best bit)
      log_best -= std::log1p(e_[j]);  // log sigmoid(|z|)
    }
    std::iota(order_.begin(), order_.end(), int64_t{0});
    std::sort(order_.begin(), order_.end(), [&](int64_t i, int64_t j) { return a_[i] < a_[j]; });
    std::fill(flip_weight_.begin(), flip_weight_.end(), 0.0);
    tail_ = 0;
    double total = 0;  // sum over K of w = p (log p - log eps + 1)
    if (log_best >= kLogEps) total = visit(0, log_best, std::exp(log_best));
    for (int64_t j = 0; j < d_; ++j) {
      const double q = 1.0 / (1.0 + std::exp(-z[j]));  // P(bit j = 1)
      const bool best_is_one = z[j] > 0;
      const double w1 = best_is_one ? total - flip_weight_[j] : flip_weight_[j];
      const double w0 = total - w1;
      // d log p(bit=1)/dz = 1 - q, d log p(bit=0)/dz = -q; H = -log eps - F.
      grad[j] = -((1 - q) * w1 - q * w0);
    }
    return -kLogEps - tail_;
  }

 private:
  // Visits the code with log-probability `logp` (= log p) whose flips end
  // before order_[start]; returns the sum of w over its subtree.
  double visit(int64_t start, double logp, double p) {
    tail_ += p * (logp - kLogEps);
    double subtree = p * (logp - kLogEps + 1);
    for (int64_t i = start; i < d_; ++i) {
      const int64_t j = order_[i];
      const double child = logp - a_[j];
      if (child < kLogEps) break;  // and so would every later (larger) flip
      const double s = visit(i + 1, child, p * e_[j]);
      flip_weight_[j] += s;
      subtree += s;
    }
    return subtree;
  }

  static inline const double kLogEps = std::log(kEntropyEps);
  int64_t d_;
  std::vector<double> a_, e_;
  std::vector<int64_t> order_;
  std::vector<double> flip_weight_;  // sum of w over codes with bit j flipped
  double tail_ = 0;                  // sum over K of p (log p - log eps)
};

Tensor zero_like_scalar(const Tensor& like) { return zeros({}, options_of(like)); }

// The product distribution of k independent bits, pi [k, 2] -> P [2^k]
// (index bits most significant first), built in place from the front.
template <class T>
void bit_product_row(const T* pi, int64_t k, T* P) {
  P[0] = 1;
  for (int64_t j = 0, n = 1; j < k; ++j, n *= 2)
    for (int64_t c = n - 1; c >= 0; --c) {
      const T v = P[c];
      P[2 * c + 1] = v * pi[2 * j + 1];
      P[2 * c] = v * pi[2 * j];
    }
}

// dL/dpi [k, 2] from dL/dP [2^k]: the sum of gP over the codes with bit j = b,
// each times the product of the other bits' probabilities (prefix bits times
// suffix bits, no division, so tiny probabilities stay exact).
template <class T>
void bit_product_row_grad(const T* pi, int64_t k, const T* gP, T* gpi, std::vector<T>& pre,
                          std::vector<T>& suf) {
  for (int64_t j = 0; j < k; ++j) {
    const int64_t n_hi = int64_t(1) << j, n_lo = int64_t(1) << (k - 1 - j);
    pre.resize(n_hi);
    suf.resize(n_lo);
    bit_product_row(pi, j, pre.data());
    bit_product_row(pi + 2 * (j + 1), k - 1 - j, suf.data());
    T g[2] = {0, 0};
    for (int64_t hi = 0; hi < n_hi; ++hi)
      for (int64_t b = 0; b < 2; ++b) {
        const T* row = gP + (hi * 2 + b) * n_lo;
        T acc = 0;
        for (int64_t lo = 0; lo < n_lo; ++lo) acc += row[lo] * suf[lo];
        g[b] += acc * pre[hi];
      }
    gpi[2 * j] = g[0];
    gpi[2 * j + 1] = g[1];
  }
}

void for_rows(int64_t rows, int64_t work_per_row, const std::function<void(int64_t)>& f) {
  const int64_t grain =
      std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(1, work_per_row));
  cpu::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) f(r);
  });
}

// mean over codebooks of H_eps(avg), avg [C, K].
Tensor clamped_entropy_mean(const Tensor& avg) {
  const Tensor h = -sum(avg * log(clamp(avg, kEntropyEps, NAN)), {-1});
  return mean(h);
}

}  // namespace

// Product distributions of pi [R, k, 2] -> [R, 2^k], differentiable in pi.
// One kernel rather than k broadcast multiplies: the engine's broadcasting
// kernels are slow on runs of length 1 and 2.
Tensor bit_product_distribution(const Tensor& pi) {
  if (pi.dim() != 3 || pi.size(2) != 2)
    throw std::invalid_argument("[bit_product_distribution] expects [rows, bits, 2], got " +
                                shape_str(pi.shape()));
  auto saved = std::make_shared<Tensor>();
  autograd::Function fn;
  fn.name = "lfq_bit_product";
  fn.forward = [saved](const std::vector<Tensor>& in) {
    const Tensor p = in[0].to(Device::cpu()).contiguous();
    *saved = p;
    const int64_t R = p.size(0), k = p.size(1), n = int64_t(1) << k;
    Tensor out = empty({R, n}, {.dtype = p.dtype()});
    auto run = [&](auto tag) {
      using T = decltype(tag);
      const T* pp = p.data<T>();
      T* po = out.data<T>();
      for_rows(R, n, [&](int64_t r) { bit_product_row(pp + r * 2 * k, k, po + r * n); });
    };
    if (p.dtype() == DType::f64)
      run(double{});
    else if (p.dtype() == DType::f32)
      run(float{});
    else
      throw std::invalid_argument("[LFQ] bit probabilities must be f32 or f64");
    return std::vector<Tensor>{out.to(in[0].device())};
  };
  fn.backward = [saved](const std::vector<Tensor>& g) {
    const Tensor& p = *saved;
    const Tensor gp = g[0].to(Device::cpu()).to(p.dtype()).contiguous();
    const int64_t R = p.size(0), k = p.size(1), n = int64_t(1) << k;
    Tensor out = empty({R, k, 2}, {.dtype = p.dtype()});
    auto run = [&](auto tag) {
      using T = decltype(tag);
      const T* pp = p.data<T>();
      const T* pg = gp.data<T>();
      T* po = out.data<T>();
      cpu::parallel_for(0, R, std::max<int64_t>(1, cpu::kGrainElements / (n * k + 1)),
                        [&](int64_t lo, int64_t hi) {
                          std::vector<T> pre, suf;
                          for (int64_t r = lo; r < hi; ++r)
                            bit_product_row_grad(pp + r * 2 * k, k, pg + r * n, po + r * 2 * k, pre,
                                                 suf);
                        });
    };
    if (p.dtype() == DType::f64)
      run(double{});
    else
      run(float{});
    return std::vector<Tensor>{out.to(g[0].device())};
  };
  return autograd::apply(fn, {pi})[0];
}

Tensor local_token_mean(const Tensor& sum, int64_t count) {
  return count > 0 ? sum / double(count) : sum;
}

Tensor clamped_bit_product_entropy(const Tensor& bit_logits) {
  if (bit_logits.dim() != 2)
    throw std::invalid_argument("[LFQ] bit logits must be [rows, bits], got " +
                                shape_str(bit_logits.shape()));
  auto grad = std::make_shared<Tensor>();
  autograd::Function fn;
  fn.name = "lfq_clamped_entropy";
  fn.forward = [grad](const std::vector<Tensor>& in) {
    const Tensor z = in[0].to(Device::cpu()).to(DType::f64).contiguous();
    const int64_t R = z.size(0), d = z.size(1);
    Tensor h = empty({R}, {.dtype = DType::f64});
    *grad = empty({R, d}, {.dtype = DType::f64});
    const double* pz = z.data<double>();
    double* ph = h.data<double>();
    double* pg = grad->data<double>();
    cpu::parallel_for(0, R, 16, [&](int64_t lo, int64_t hi) {
      ClampedEntropyWalk walk(d);
      for (int64_t r = lo; r < hi; ++r) ph[r] = walk.run(pz + r * d, pg + r * d);
    });
    return std::vector<Tensor>{h.to(in[0].dtype()).to(in[0].device())};
  };
  fn.backward = [grad](const std::vector<Tensor>& g) {
    const Tensor dz = grad->to(g[0].dtype()).to(g[0].device());
    return std::vector<Tensor>{unsqueeze(g[0], -1) * dz};
  };
  return autograd::apply(fn, {bit_logits})[0];
}

LFQEntropy lfq_entropy_factorised(const Tensor& z, const TokenMean& token_mean) {
  if (z.dim() != 3)
    throw std::invalid_argument("[LFQ] bit logits must be [tokens, codebooks, bits], got " +
                                shape_str(z.shape()));
  const int64_t T = z.size(0), C = z.size(1), d = z.size(2);
  LFQEntropy out;
  // Per-token entropies averaged over codebooks, then over tokens through
  // token_mean (a cross-rank mean in a distributed run).
  out.per_sample =
      token_mean(sum(clamped_bit_product_entropy(reshape(z, {T * C, d}))) / double(C), T);
  // P(bit = 0) and P(bit = 1) as sigmoid(-z), sigmoid(z): each accurate in its tail.
  const Tensor pi = reshape(stack({sigmoid(-z), sigmoid(z)}, -1), {T * C, d, 2});
  const int64_t high = d / 2;
  const Tensor A =
      reshape(bit_product_distribution(slice(pi, 1, 0, high)), {T, C, int64_t(1) << high});
  const Tensor B =
      reshape(bit_product_distribution(slice(pi, 1, high, d)), {T, C, int64_t(1) << (d - high)});
  const Tensor sum_ab = bmm(contiguous(permute(A, {1, 2, 0})), contiguous(permute(B, {1, 0, 2})));
  const Tensor avg = token_mean(reshape(sum_ab, {C, A.size(2) * B.size(2)}), T);  // [C, 2^d]
  out.batch = clamped_entropy_mean(avg);
  return out;
}

LFQEntropy lfq_entropy_direct(const Tensor& x, const Tensor& codebook, double inv_temperature,
                              const TokenMean& token_mean) {
  if (x.dim() != 3)
    throw std::invalid_argument("[LFQ] direct entropy expects [tokens, codebooks, bits], got " +
                                shape_str(x.shape()));
  const int64_t T = x.size(0);
  const Tensor logits = matmul(x, codebook.t().to(x.dtype())) * (2.0 * inv_temperature);
  const Tensor p = softmax(logits, -1);  // [T, C, K]
  LFQEntropy out;
  const int64_t C = x.size(1);
  out.per_sample =
      token_mean(sum(-sum(p * log(clamp(p, kEntropyEps, NAN)), {-1})) / double(C), T);
  out.batch = clamped_entropy_mean(token_mean(sum(p, {0}), T));
  return out;
}

}  // namespace quanta::quant
