// recompute: a custom autograd function whose backward rebuilds the graph of
// fn on a detached copy of the input and takes its gradients there.
#include "engine/nn/recompute.h"

#include "engine/autograd/function.h"
#include "engine/autograd/grad_mode.h"
#include "engine/autograd/node.h"

namespace quanta {
namespace {

std::vector<GeneratorState> states_of(const std::vector<Generator*>& streams) {
  std::vector<GeneratorState> s;
  s.reserve(streams.size());
  for (const Generator* g : streams) s.push_back(g->state());
  return s;
}

void restore(const std::vector<Generator*>& streams, const std::vector<GeneratorState>& states) {
  for (size_t i = 0; i < streams.size(); ++i) streams[i]->set_state(states[i]);
}

}  // namespace

Tensor recompute(const std::function<Tensor(const Tensor&)>& fn, const Tensor& input,
                 const std::vector<Tensor>& parameters, const std::vector<Generator*>& streams) {
  std::vector<Tensor> trainable;
  for (const Tensor& p : parameters)
    if (p.requires_grad()) trainable.push_back(p);
  std::vector<Tensor> inputs{input};
  inputs.insert(inputs.end(), trainable.begin(), trainable.end());
  if (!autograd::any_requires_grad(inputs)) return fn(input);

  const std::vector<GeneratorState> at_forward = states_of(streams);
  const Tensor saved = input.detach();
  const bool input_grad = input.requires_grad();
  autograd::Function f;
  f.name = "recompute";
  f.forward = [fn](const std::vector<Tensor>& in) { return std::vector<Tensor>{fn(in[0])}; };
  f.backward = [fn, saved, input_grad, trainable, streams,
                at_forward](const std::vector<Tensor>& grads) {
    const std::vector<GeneratorState> now = states_of(streams);
    restore(streams, at_forward);
    Tensor out;
    Tensor x = saved.detach();
    if (input_grad) x.requires_grad_(true);
    {
      EnableGradGuard grad_on;
      RecomputingGuard recomputing;
      out = fn(x);
    }
    restore(streams, now);
    std::vector<Tensor> wrt;
    if (input_grad) wrt.push_back(x);
    wrt.insert(wrt.end(), trainable.begin(), trainable.end());
    std::vector<Tensor> g = out.requires_grad() ? autograd::grad({out}, wrt, {grads[0]})
                                                : std::vector<Tensor>(wrt.size());
    std::vector<Tensor> result;
    result.reserve(1 + trainable.size());
    result.push_back(input_grad ? g[0] : Tensor());
    result.insert(result.end(), g.begin() + (input_grad ? 1 : 0), g.end());
    return result;
  };
  return autograd::apply(f, inputs)[0];
}

Tensor recompute(Module& module, const Tensor& input) {
  // module(x): its forward hooks run in the forward and again in the recomputation.
  return recompute([&module](const Tensor& x) { return module(x); }, input, module.parameters(),
                   module.random_streams());
}

}  // namespace quanta
