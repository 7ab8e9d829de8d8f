// The CPU's causal-LM loss rows: a row of logits (a whole vocabulary, a few
// hundred KB) is read from memory once into the cache, where its max, its
// sum of exponentials and, for the gradient, softmax less the target are
// formed in place; the math per element is llm/kernels/functors.h's.
#include <algorithm>
#include <cmath>

#include "engine/cpu/parallel.h"
#include "engine/eigen.h"
#include "llm/cpu/kernels.h"
#include "llm/kernels/functors.h"

namespace quanta::llm::llm_cpu {

void lm_loss_rows(DType dtype, void* logits_, const int64_t* targets, int64_t rows, int64_t vocab,
                  int64_t ignore_index, bool grad, void* loss_) {
  dispatch_float(dtype, "lm_loss_rows", [&](auto tag) {
    using A = typename decltype(tag)::type;
    A* logits = static_cast<A*>(logits_);
    A* loss = static_cast<A*>(loss_);
    cpu::parallel_for(0, rows, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        Eigen::Map<Eigen::Array<A, Eigen::Dynamic, 1>> x(logits + r * vocab, vocab);
        const int64_t t = targets[r];
        const bool counted = t != ignore_index;
        if (!counted || vocab == 0) {
          loss[r] = A(0);
          if (grad) x.setZero();
          continue;
        }
        const A m = x.maxCoeff();
        const A target_logit = x[t];
        if (!grad) {
          loss[r] = fn::lm_row_loss<A>(m, (x - m).exp().sum(), target_logit);
          continue;
        }
        // e = exp(x - m) in place, then the gradient from it.
        x = (x - m).exp();
        const A s = x.sum();
        loss[r] = fn::lm_row_loss<A>(m, s, target_logit);
        const A inv = A(1) / s, e_target = x[t];
        x *= inv;  // fn::lm_logit_grad off the target (e * inv), vectorised
        x[t] = fn::lm_logit_grad<A>(e_target, inv, true);
      }
    });
  });
}

}  // namespace quanta::llm::llm_cpu
