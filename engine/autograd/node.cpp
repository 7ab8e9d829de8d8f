#include "engine/autograd/node.h"

#include <atomic>
#include <stdexcept>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/precision.h"

namespace quanta {
namespace {
// Only ever incremented; order matters, not the values (so relaxed is fine).
std::atomic<uint64_t> g_next_sequence_nr{0};

OutputMeta meta_of(const Tensor& t) { return {t.shape(), t.dtype(), t.device()}; }

// An op recorded without a backward formula fails by name when a gradient
// must pass through it (not when it is recorded: a forward alone is fine).
BackwardFn or_no_rule(const std::string& op, BackwardFn fn) {
  if (fn) return fn;
  return [op](const std::vector<Tensor>&) -> std::vector<Tensor> {
    throw std::runtime_error("[" + op + "] has no gradient rule");
  };
}
}  // namespace

Node::Node(std::string name, std::vector<Edge> next_edges, std::vector<OutputMeta> outputs)
    : name_(std::move(name)),
      next_edges_(std::move(next_edges)),
      outputs_(std::move(outputs)),
      sequence_nr_(g_next_sequence_nr.fetch_add(1, std::memory_order_relaxed)),
      mixed_precision_(mixed_precision_enabled()) {}

FunctionNode::FunctionNode(std::string name, std::vector<Edge> next,
                           std::vector<OutputMeta> outputs, BackwardFn fn)
    : Node(std::move(name), std::move(next), std::move(outputs)),
      fn_(or_no_rule(this->name(), std::move(fn))) {}

std::vector<Tensor> FunctionNode::apply(const std::vector<Tensor>& grad_outputs) {
  if (!fn_) throw std::runtime_error("[" + name() + "] applied after its graph was freed");
  return fn_(grad_outputs);
}

AccumulateGrad::AccumulateGrad(std::shared_ptr<TensorImpl> leaf)
    : Node("AccumulateGrad", {}, {meta_of(Tensor(leaf))}), leaf_(std::move(leaf)) {}

std::vector<Tensor> AccumulateGrad::apply(const std::vector<Tensor>& grad_outputs) {
  Tensor leaf(leaf_);
  const Tensor& g = grad_outputs.at(0);
  AutogradMeta& m = leaf_->meta();
  if (!m.grad.defined()) {
    // Adopted when nothing else sees it; otherwise a fresh copy, since `g`
    // may alias another gradient that later accumulates.
    m.grad = g.dtype() == leaf.dtype() && autograd::sole_owner(g) ? g : g.to(leaf.dtype()).clone();
  } else {
    add_(m.grad, g);
  }
  for (auto& hook : m.post_accumulate_hooks) hook(leaf);
  return {};
}

namespace autograd {

bool sole_storage(const Tensor& t) {
  return t.defined() && t.impl_ptr().use_count() == 1 && t.storage().use_count() == 1 &&
         t.is_contiguous() && t.offset() == 0 && t.nbytes() == t.storage()->nbytes();
}

bool sole_owner(const Tensor& t) { return sole_storage(t) && !t.requires_grad(); }

bool any_requires_grad(const std::vector<Tensor>& inputs) {
  if (!grad_enabled()) return false;
  for (const auto& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

Edge edge_of(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return {};
  if (t.grad_fn()) return {t.grad_fn(), t.output_nr()};
  TensorImpl* impl = t.impl();
  AutogradMeta& m = impl->meta();
  auto acc = m.grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(t.impl_ptr());
    m.grad_accumulator = acc;
  }
  return {acc, 0};
}

std::vector<Tensor> record(const char* op, std::vector<Tensor> outs,
                           const std::vector<Tensor>& inputs, BackwardFn backward) {
  if (!any_requires_grad(inputs)) return outs;
  std::vector<Edge> edges;
  edges.reserve(inputs.size());
  for (const auto& in : inputs) edges.push_back(edge_of(in));
  std::vector<OutputMeta> metas;
  for (const auto& o : outs) {
    // An op that returned an input unchanged records nothing: the gradient
    // already flows through that input's own history.
    for (const auto& in : inputs)
      if (o.is_same(in)) return outs;
    metas.push_back(meta_of(o));
  }
  auto node =
      std::make_shared<FunctionNode>(op, std::move(edges), std::move(metas), std::move(backward));
  for (uint32_t i = 0; i < outs.size(); ++i) {
    if (!is_floating(outs[i].dtype())) continue;  // indices never carry grads
    AutogradMeta& m = outs[i].impl()->meta();
    m.requires_grad = true;
    m.grad_fn = node;
    m.output_nr = i;
  }
  return outs;
}

Tensor record(const char* op, Tensor out, const std::vector<Tensor>& inputs,
              std::function<std::vector<Tensor>(const Tensor& grad)> backward) {
  if (!any_requires_grad(inputs)) return out;
  BackwardFn fn;  // stays empty (no gradient rule) when `backward` is
  if (backward)
    fn = [single = std::move(backward)](const std::vector<Tensor>& g) { return single(g[0]); };
  return record(op, std::vector<Tensor>{std::move(out)}, inputs, std::move(fn))[0];
}

}  // namespace autograd
}  // namespace quanta
