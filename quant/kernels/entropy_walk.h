#pragma once
// LFQ's per-token clamped entropy (quant/scalar/lfq_entropy.h has the maths)
// as one walk written for g++ and nvcc: the CPU entry runs it on std::vector
// scratch, the CUDA entry one thread per token on local arrays, so the CPU
// tests cover the walk the GPU runs.
//
// The codes with p >= eps are the most likely code with a set S of bits
// flipped; flipping bit j lowers log p by |z_j|. The walk is depth-first:
// the children of a code flip one more bit, later in |z| order than every
// bit already in S, so each code is visited once, and since flips only lower
// log p, a child is in K only if its parent is, and the first flip that
// leaves K ends its parent's loop (every later bit's |z| is larger). It is
// iterative, with an explicit stack of at most d + 1 frames, and adds in the
// order a recursion would.
#include <cmath>
#include <cstdint>

#include "engine/kernels/functors.h"  // QUANTA_HD

namespace quanta::quant::fn {

/** One code on the walk's stack. */
struct EntropyFrame {
  int64_t next;    // the position in `order` whose flip this code tries next
  int64_t via;     // the bit whose flip reached it (-1: the most likely code)
  double logp;     // log p of the code
  double p;        // p of the code
  double subtree;  // sum of w = p (log p - log eps + 1) over its subtree so far
};

/** a[j] = |z_j| and e[j] = exp(-|z_j|) (p(flipped bit) / p(likely bit));
 * returns log p of the most likely code, the sum of log sigmoid(|z_j|). */
QUANTA_HD inline double entropy_magnitudes(const double* z, int64_t d, double* a, double* e) {
  double log_best = 0;
  for (int64_t j = 0; j < d; ++j) {
    a[j] = std::fabs(z[j]);
    e[j] = std::exp(-a[j]);
    log_best -= std::log1p(e[j]);
  }
  return log_best;
}

/** order[0..d) = the bits by increasing a, equal ones by index (a stable
 * insertion sort: the device's; std::stable_sort gives the same order). */
QUANTA_HD inline void order_by_magnitude(const double* a, int64_t d, int64_t* order) {
  for (int64_t i = 0; i < d; ++i) {
    int64_t at = i;
    while (at > 0 && a[order[at - 1]] > a[i]) {
      order[at] = order[at - 1];
      --at;
    }
    order[at] = i;
  }
}

/** The clamped entropy H_eps of the token with bit logits z[0..d), and
 * dH/dz into grad[0..d). a, e and log_best from entropy_magnitudes, order
 * from order_by_magnitude (or a stable sort); scratch: flip_weight [d],
 * stack [d + 1]. log_eps = log(kEntropyEps), passed in so that every device
 * uses the host's value. */
QUANTA_HD inline double clamped_entropy_walk(const double* z, int64_t d, double log_eps,
                                             double log_best, const double* a, const double* e,
                                             const int64_t* order, double* flip_weight,
                                             EntropyFrame* stack, double* grad) {
  for (int64_t j = 0; j < d; ++j) flip_weight[j] = 0;  // sum of w over codes with bit j flipped
  double tail = 0;                                     // sum over K of p (log p - log eps)
  double total = 0;                                    // sum over K of w
  if (log_best >= log_eps) {
    const auto enter = [&](int64_t at, int64_t next, int64_t via, double logp, double p) {
      tail += p * (logp - log_eps);
      stack[at] = EntropyFrame{next, via, logp, p, p * (logp - log_eps + 1)};
    };
    int64_t top = 0;
    enter(0, 0, -1, log_best, std::exp(log_best));
    for (;;) {
      EntropyFrame& f = stack[top];
      if (f.next < d) {
        const int64_t j = order[f.next];
        const double child = f.logp - a[j];
        if (child >= log_eps) {
          ++f.next;
          enter(top + 1, f.next, j, child, f.p * e[j]);
          ++top;
          continue;
        }
        f.next = d;  // and so would every later (larger) flip
      }
      const double s = f.subtree;  // this code's subtree is done
      if (top == 0) {
        total = s;
        break;
      }
      flip_weight[f.via] += s;
      --top;
      stack[top].subtree += s;
    }
  }
  for (int64_t j = 0; j < d; ++j) {
    const double q = 1.0 / (1.0 + std::exp(-z[j]));  // P(bit j = 1)
    const bool best_is_one = z[j] > 0;
    const double w1 = best_is_one ? total - flip_weight[j] : flip_weight[j];
    const double w0 = total - w1;
    // d log p(bit=1)/dz = 1 - q, d log p(bit=0)/dz = -q; H = -log eps - F.
    grad[j] = -((1 - q) * w1 - q * w0);
  }
  return -log_eps - tail;
}

}  // namespace quanta::quant::fn
