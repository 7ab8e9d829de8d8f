// CPU entries bit_probabilities(_grad), bit_product(_grad) and clamped_entropy
// (quant/kernels/table.h): LFQ's entropy terms over per-bit distributions
// (see quant/scalar/lfq_entropy.h for the maths).
#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/cpu/parallel.h"
#include "quant/cpu/kernels.h"
#include "quant/kernels/entropy_walk.h"
#include "quant/kernels/functors.h"

namespace quanta::quant::quant_cpu {
namespace {

// The walk over K = {codes with p >= eps} of one token
// (quant/kernels/entropy_walk.h), on scratch reused across a thread's rows.
class ClampedEntropyWalk {
 public:
  explicit ClampedEntropyWalk(int64_t d)
      : d_(d), a_(d), e_(d), flip_weight_(d), order_(d), stack_(d + 1) {}

  // Entropy of the token with bit logits z[0..d); writes dH/dz to grad.
  double run(const double* z, double* grad) {
    const double log_best = fn::entropy_magnitudes(z, d_, a_.data(), e_.data());
    std::iota(order_.begin(), order_.end(), int64_t{0});
    std::stable_sort(order_.begin(), order_.end(),
                     [&](int64_t i, int64_t j) { return a_[i] < a_[j]; });
    return fn::clamped_entropy_walk(z, d_, kLogEps, log_best, a_.data(), e_.data(), order_.data(),
                                    flip_weight_.data(), stack_.data(), grad);
  }

 private:
  static inline const double kLogEps = std::log(kEntropyEps);
  int64_t d_;
  std::vector<double> a_, e_, flip_weight_;
  std::vector<int64_t> order_;
  std::vector<fn::EntropyFrame> stack_;
};

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

// f(T{}) for an f32 or f64 `dtype`; otherwise throws "[LFQ] <what> must
// be f32 or f64".
template <class F>
void dispatch_lfq(DType dtype, const char* what, F&& f) {
  if (dtype == DType::f64) return f(double{});
  if (dtype == DType::f32) return f(float{});
  throw std::invalid_argument(std::string("[LFQ] ") + what + " must be f32 or f64");
}

}  // namespace

void bit_probabilities(DType dtype, const void* z, int64_t R, int64_t d, int64_t begin, int64_t k,
                       void* pi) {
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* pz = static_cast<const T*>(z);
    T* pp = static_cast<T*>(pi);
    for_rows(R, k, [&](int64_t r) {
      for (int64_t j = 0; j < k; ++j)
        fn::bit_probabilities(pz[r * d + begin + j], pp + (r * k + j) * 2);
    });
  };
  dispatch_lfq(dtype, "bit logits", run);
}

void bit_probabilities_grad(DType dtype, const void* z, const void* g, int64_t R, int64_t d,
                            int64_t begin, int64_t k, void* dz) {
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* pz = static_cast<const T*>(z);
    const T* pg = static_cast<const T*>(g);
    T* out = static_cast<T*>(dz);
    for_rows(R, k, [&](int64_t r) {
      for (int64_t j = 0; j < k; ++j) {
        T p[2];
        fn::bit_probabilities(pz[r * d + begin + j], p);
        const T* gj = pg + (r * k + j) * 2;
        out[r * d + begin + j] = fn::bit_probability_grad(gj[0], gj[1], p[0], p[1]);
      }
    });
  };
  dispatch_lfq(dtype, "bit logits", run);
}

void bit_product(DType dtype, const void* pi, int64_t R, int64_t k, void* out) {
  const int64_t n = int64_t(1) << k;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* pp = static_cast<const T*>(pi);
    T* po = static_cast<T*>(out);
    for_rows(R, n, [&](int64_t r) { bit_product_row(pp + r * 2 * k, k, po + r * n); });
  };
  dispatch_lfq(dtype, "bit probabilities", run);
}

void bit_product_grad(DType dtype, const void* pi, const void* grad_out, int64_t R, int64_t k,
                      void* grad_pi) {
  const int64_t n = int64_t(1) << k;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* pp = static_cast<const T*>(pi);
    const T* pg = static_cast<const T*>(grad_out);
    T* po = static_cast<T*>(grad_pi);
    cpu::parallel_for(
        0, R, std::max<int64_t>(1, cpu::kGrainElements / (n * k + 1)), [&](int64_t lo, int64_t hi) {
          std::vector<T> pre, suf;
          for (int64_t r = lo; r < hi; ++r)
            bit_product_row_grad(pp + r * 2 * k, k, pg + r * n, po + r * 2 * k, pre, suf);
        });
  };
  if (dtype == DType::f64)
    run(double{});
  else
    run(float{});
}

void clamped_entropy(const double* pz, int64_t R, int64_t d, double* ph, double* pg) {
  cpu::parallel_for(0, R, 16, [&](int64_t lo, int64_t hi) {
    ClampedEntropyWalk walk(d);
    for (int64_t r = lo; r < hi; ++r) ph[r] = walk.run(pz + r * d, pg + r * d);
  });
}

}  // namespace quanta::quant::quant_cpu
