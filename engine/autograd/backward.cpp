// The reverse-mode engine: counts dependencies from the roots, then runs each
// node once all gradients flowing into it have been summed.
#include <queue>
#include <stdexcept>
#include <unordered_map>

#include "engine/autograd/grad_mode.h"
#include "engine/autograd/node.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/precision.h"

namespace quanta::autograd {
namespace {

struct LaterFirst {
  bool operator()(const Node* a, const Node* b) const {
    return a->sequence_nr() < b->sequence_nr();
  }
};

std::unordered_map<Node*, int> count_dependencies(const std::vector<Edge>& roots) {
  std::unordered_map<Node*, int> deps;
  std::vector<Node*> stack;
  std::unordered_map<Node*, bool> seen;
  for (const auto& e : roots)
    if (e.node && !seen[e.node.get()]) {
      seen[e.node.get()] = true;
      stack.push_back(e.node.get());
    }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const auto& e : n->next_edges()) {
      if (!e.node) continue;
      ++deps[e.node.get()];
      if (!seen[e.node.get()]) {
        seen[e.node.get()] = true;
        stack.push_back(e.node.get());
      }
    }
  }
  return deps;
}

void check_grad(const Node& producer, size_t input_index, const Node& consumer, uint32_t slot,
                const Tensor& g) {
  const OutputMeta& want = consumer.outputs().at(slot);
  if (g.shape() != want.shape)
    throw std::runtime_error("[backward] " + producer.name() + " returned a gradient of shape " +
                             shape_str(g.shape()) + " for input " + std::to_string(input_index) +
                             " whose shape is " + shape_str(want.shape));
}

using Accumulator = std::unordered_map<Node*, std::vector<Tensor>>;

// The sums the running formula may add into (gradient_sink), one per input
// of its node, undefined where none is offered.
thread_local const std::vector<Tensor>* t_sinks = nullptr;

// Offers a node's formula the pending sums of its inputs that nothing else
// holds, while it runs; restores the outer offer after (a formula may run a
// backward of its own: recomputation).
class SinkScope {
 public:
  SinkScope(const Node& node, const Accumulator& pending) : outer_(t_sinks) {
    // Sized only when something is offered: most nodes have nothing.
    const auto& edges = node.next_edges();
    for (size_t i = 0; i < edges.size(); ++i) {
      if (!edges[i].node) continue;
      const auto it = pending.find(edges[i].node.get());
      if (it == pending.end() || edges[i].input_nr >= it->second.size()) continue;
      const Tensor& sum = it->second[edges[i].input_nr];
      // Checked before this copy: one input of two reaching the same sum
      // (x * x) is offered it, the other not.
      if (!sum.defined() || !sole_owner(sum)) continue;
      sinks_.resize(edges.size());
      sinks_[i] = sum;
    }
    t_sinks = &sinks_;
  }
  ~SinkScope() { t_sinks = outer_; }
  SinkScope(const SinkScope&) = delete;
  SinkScope& operator=(const SinkScope&) = delete;

  /** Per input, whether the formula returned the sum it was offered: its
   * gradient is in there already. */
  std::vector<bool> taken(const std::vector<Tensor>& grads) const {
    std::vector<bool> out(grads.size(), false);
    for (size_t i = 0; i < std::min(grads.size(), sinks_.size()); ++i)
      out[i] = sinks_[i].defined() && sinks_[i].is_same(grads[i]);
    return out;
  }

 private:
  std::vector<Tensor> sinks_;
  const std::vector<Tensor>* outer_;
};

void add_to(Accumulator& acc, Node* node, uint32_t slot, const Tensor& g) {
  auto& slots = acc[node];
  const size_t n = std::max<size_t>(node->outputs().size(), 1);
  if (slots.size() < n) slots.resize(n);
  Tensor& sum = slots[slot];
  if (!sum.defined())
    sum = g;
  else if (sum.dtype() == g.dtype() && sole_owner(sum))
    add_(sum, g);  // nothing else sees this buffer: no new one
  else
    sum = add(sum, g);
}

// Runs the graph above `roots`. With `capture`, gradients that reach the
// capture edges are returned there instead of accumulating into leaves.
void run(const std::vector<Edge>& roots, const std::vector<Tensor>& seeds, bool retain_graph,
         std::unordered_map<Node*, Tensor>* capture) {
  auto deps = count_dependencies(roots);
  Accumulator pending;
  for (size_t i = 0; i < roots.size(); ++i)
    if (roots[i].node) add_to(pending, roots[i].node.get(), roots[i].input_nr, seeds[i]);

  std::priority_queue<Node*, std::vector<Node*>, LaterFirst> ready;
  std::unordered_map<Node*, bool> queued;
  for (const auto& e : roots)
    if (e.node && deps[e.node.get()] == 0 && !queued[e.node.get()]) {
      queued[e.node.get()] = true;
      ready.push(e.node.get());
    }

  NoGradGuard no_grad;  // backward formulas build no graph of their own
  while (!ready.empty()) {
    Node* node = ready.top();
    ready.pop();
    std::vector<Tensor> grads = std::move(pending[node]);
    pending.erase(node);

    if (capture) {
      auto it = capture->find(node);
      if (it != capture->end()) {
        it->second = grads.empty() ? Tensor() : grads[0];
        if (dynamic_cast<AccumulateGrad*>(node)) continue;
      }
    }
    if (node->released())
      throw std::runtime_error("[backward] the graph through " + node->name() +
                               " was already freed by an earlier backward; pass "
                               "retain_graph=true to the first one");
    grads.resize(std::max<size_t>(node->outputs().size(), 1));
    for (size_t i = 0; i < node->outputs().size(); ++i)
      if (!grads[i].defined()) {
        const auto& m = node->outputs()[i];
        grads[i] = zeros(m.shape, {.dtype = m.dtype, .device = m.device});
      }
    std::vector<Tensor> in_grads;
    std::vector<bool> summed;
    {
      const MixedPrecision precision(node->mixed_precision());
      // Released before the sums below: an offered sum the formula left is
      // again sole-owned, so adding into it stays in place.
      const SinkScope sinks(*node, pending);
      in_grads = node->apply(grads);
      summed = sinks.taken(in_grads);
    }
    if (!retain_graph) node->release();

    const auto& edges = node->next_edges();
    if (in_grads.size() != edges.size())
      throw std::runtime_error("[" + node->name() + "] backward returned " +
                               std::to_string(in_grads.size()) + " gradients, expected " +
                               std::to_string(edges.size()));
    for (size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.node) continue;
      // Undefined means zero (see BackwardFn): nothing to add, but the input
      // still counts this edge as done (a node reached by nothing else runs
      // on zeros, so a leaf's .grad then holds zeros).
      // A gradient the formula added into its input's sum is in already.
      if (in_grads[i].defined() && !(i < summed.size() && summed[i])) {
        check_grad(*node, i, *e.node, e.input_nr, in_grads[i]);
        add_to(pending, e.node.get(), e.input_nr, in_grads[i]);
      }
      if (--deps[e.node.get()] == 0 && !queued[e.node.get()]) {
        queued[e.node.get()] = true;
        ready.push(e.node.get());
      }
    }
  }
}

std::vector<Tensor> seed_gradients(const std::vector<Tensor>& roots,
                                   const std::vector<Tensor>& grads) {
  if (!grads.empty() && grads.size() != roots.size())
    throw std::invalid_argument("[backward] got " + std::to_string(grads.size()) +
                                " gradients for " + std::to_string(roots.size()) + " outputs");
  std::vector<Tensor> seeds;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    if (!r.defined() || !r.requires_grad())
      throw std::invalid_argument(
          "[backward] output " + std::to_string(i) +
          " does not require grad (no input of its graph has requires_grad, or it was "
          "computed under NoGradGuard)");
    Tensor g = grads.empty() ? Tensor() : grads[i];
    if (!g.defined()) {
      if (r.numel() != 1)
        throw std::invalid_argument(
            "[backward] a gradient can be implied only for a "
            "one-element output; got shape " +
            shape_str(r.shape()));
      g = ones(r.shape(), {.dtype = r.dtype(), .device = r.device()});
    } else if (g.shape() != r.shape()) {
      throw std::invalid_argument("[backward] gradient shape " + shape_str(g.shape()) +
                                  " does not match output shape " + shape_str(r.shape()));
    }
    seeds.push_back(g);
  }
  return seeds;
}

}  // namespace

Tensor gradient_sink(size_t input, const Shape& shape, DType dtype, Device device) {
  if (!t_sinks || input >= t_sinks->size()) return Tensor();
  const Tensor& sum = (*t_sinks)[input];
  if (!sum.defined() || sum.shape() != shape || sum.dtype() != dtype || sum.device() != device)
    return Tensor();
  return sum;
}

GradientBuffer gradient_buffer(size_t input, const Shape& shape, DType dtype, Device device) {
  Tensor sum = gradient_sink(input, shape, dtype, device);
  if (sum.defined()) return {std::move(sum), true};
  return {quanta::detail::make_tensor(shape, dtype, device), false};
}

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
              bool retain_graph) {
  auto seeds = seed_gradients(roots, grads);
  std::vector<Edge> edges;
  for (const auto& r : roots) edges.push_back(edge_of(r));
  run(edges, seeds, retain_graph, nullptr);
}

std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_outputs, bool retain_graph) {
  auto seeds = seed_gradients(outputs, grad_outputs);
  std::vector<Edge> edges;
  for (const auto& r : outputs) edges.push_back(edge_of(r));
  std::unordered_map<Node*, Tensor> capture;
  std::vector<Node*> keys;
  for (const auto& in : inputs) {
    if (!in.requires_grad())
      throw std::invalid_argument("[autograd::grad] an input does not require grad");
    if (!in.is_leaf()) throw std::invalid_argument("[autograd::grad] inputs must be leaves");
    Edge e = edge_of(in);
    keys.push_back(e.node.get());
    capture[e.node.get()] = Tensor();
  }
  // Keep accumulators alive for the duration of the run.
  std::vector<Edge> hold;
  for (const auto& in : inputs) hold.push_back(edge_of(in));
  run(edges, seeds, retain_graph, &capture);
  std::vector<Tensor> out;
  for (Node* k : keys) out.push_back(capture[k]);
  return out;
}

}  // namespace quanta::autograd
