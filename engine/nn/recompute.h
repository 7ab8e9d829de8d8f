#pragma once
// Activation recomputation (PyTorch's torch.utils.checkpoint): a call whose
// intermediate tensors are dropped after the forward and rebuilt by running
// it again in the backward, trading a second forward for the memory of
// every activation inside it.
#include <functional>
#include <vector>

#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "engine/tensor.h"

namespace quanta {

/** fn(input), differentiable in `input` and in the `parameters` fn reads
 * (those that require grad), keeping only `input` alive until the backward.
 * The backward runs fn again with a graph and differentiates it; the
 * parameters' gradients then reach them through this op, once, as if fn had
 * been recorded (DataParallel's hooks see one gradient per parameter).
 * `streams` are the generators fn draws from (dropout): the recomputation
 * starts them where the forward did and leaves them where they were, so it
 * draws the same numbers. fn must otherwise be a pure function of its input
 * and parameters. Without grad mode, or when nothing requires grad, this is
 * fn(input). The gradient can be taken once (the graph inside is rebuilt,
 * not kept). */
Tensor recompute(const std::function<Tensor(const Tensor&)>& fn, const Tensor& input,
                 const std::vector<Tensor>& parameters,
                 const std::vector<Generator*>& streams = {});

/** recompute of module(x) (its forward hooks included) with the module's
 * parameters and random streams. */
Tensor recompute(Module& module, const Tensor& input);

}  // namespace quanta
