#include "engine/autograd/function.h"

#include "engine/autograd/grad_mode.h"
#include "engine/autograd/node.h"

namespace quanta::autograd {

std::vector<Tensor> apply(const Function& fn, const std::vector<Tensor>& inputs) {
  if (!fn.forward) throw std::invalid_argument("[" + fn.name + "] Function has no forward");
  std::vector<Tensor> outs;
  {
    NoGradGuard no_grad;
    outs = fn.forward(inputs);
  }
  if (!any_requires_grad(inputs)) return outs;
  if (!fn.backward)
    throw std::invalid_argument("[" + fn.name +
                                "] Function has no backward but an input "
                                "requires grad");
  // Fresh handles: an output may be an input returned unchanged, and its
  // history must not be overwritten.
  for (auto& o : outs) o = o.detach();
  return record(fn.name.c_str(), std::move(outs), inputs, fn.backward);
}

}  // namespace quanta::autograd
