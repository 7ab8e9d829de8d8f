#pragma once
// Custom autograd functions: the caller supplies forward and backward. Used by
// straight-through estimators and differentiable collectives.
#include <functional>
#include <string>
#include <vector>

#include "engine/tensor.h"

namespace quanta::autograd {

struct Function {
  /** Shown in errors and graph dumps. */
  std::string name;
  /** Runs with grad mode off; returns the outputs. */
  std::function<std::vector<Tensor>(const std::vector<Tensor>& inputs)> forward;
  /** Gradients of the outputs (zeros where an output was unused) to one
   * gradient per input (undefined for inputs without one). */
  std::function<std::vector<Tensor>(const std::vector<Tensor>& grad_outputs)> backward;
};

/** Runs `fn.forward` and, when an input requires grad, links its outputs to
 * `fn.backward` in the graph. */
std::vector<Tensor> apply(const Function& fn, const std::vector<Tensor>& inputs);

}  // namespace quanta::autograd
