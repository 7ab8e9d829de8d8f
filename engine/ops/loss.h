#pragma once
// Losses and one_hot. Every loss takes a Reduction: none keeps one value per
// sample, mean averages them (empty input gives NaN, as in PyTorch) and sum
// adds them (empty input gives 0).
#include <cstdint>

#include "engine/tensor.h"

namespace quanta {

enum class Reduction { none, mean, sum };

/** Cross entropy of `logits` [N, C, d1, ...] (or [C]) against `target`, as
 * torch.nn.functional.cross_entropy: either integer class indices [N, d1, ...]
 * (or 0-d), where targets equal to `ignore_index` add nothing and mean divides
 * by the number of the others (NaN when all are ignored), or class
 * probabilities of the logits' shape (floating). Label smoothing ε mixes the
 * target with the uniform distribution: (1-ε)·nll + ε·mean over classes of
 * -log p. */
Tensor cross_entropy(const Tensor& logits, const Tensor& target,
                     Reduction reduction = Reduction::mean, int64_t ignore_index = -100,
                     double label_smoothing = 0.0);
/** Squared error (a - b)^2; `a` and `b` must have the same shape. */
Tensor mse_loss(const Tensor& a, const Tensor& b, Reduction reduction = Reduction::mean);
/** Absolute error |a - b|; `a` and `b` must have the same shape. */
Tensor l1_loss(const Tensor& a, const Tensor& b, Reduction reduction = Reduction::mean);
/** (nd) i64 tensor of shape [*indices.shape, num_classes] with a 1 at each
 * index; num_classes = -1 uses max(indices) + 1. */
Tensor one_hot(const Tensor& indices, int64_t num_classes = -1);

}  // namespace quanta
