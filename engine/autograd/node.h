#pragma once
// Graph nodes for reverse-mode autograd. A node maps the gradients of its
// outputs to the gradients of its inputs; edges point at the inputs' nodes.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/tensor.h"

namespace quanta {

struct Edge {
  std::shared_ptr<Node> node;  // null: that input needs no gradient
  uint32_t input_nr = 0;       // which output of `node` the input was
};

/** Shape, dtype and device of one node output (to build zero gradients and
 * to check the shapes backward formulas return). */
struct OutputMeta {
  Shape shape;
  DType dtype;
  Device device;
};

class Node {
 public:
  Node(std::string name, std::vector<Edge> next_edges, std::vector<OutputMeta> outputs);
  virtual ~Node() = default;

  /** Gradients of the inputs (one per next edge; undefined means zero) from
   * the gradients of the outputs (one per output, never undefined). */
  virtual std::vector<Tensor> apply(const std::vector<Tensor>& grad_outputs) = 0;
  /** Frees saved tensors after a backward without retain_graph. */
  virtual void release() {}
  virtual bool released() const { return false; }

  const std::string& name() const { return name_; }
  const std::vector<Edge>& next_edges() const { return next_edges_; }
  const std::vector<OutputMeta>& outputs() const { return outputs_; }
  /** Creation order; later nodes run first when several are ready. */
  uint64_t sequence_nr() const { return sequence_nr_; }
  /** Whether MixedPrecision was on when the node was made: its backward
   * runs in the same product precision (engine/precision.h). */
  bool mixed_precision() const { return mixed_precision_; }

 private:
  std::string name_;
  std::vector<Edge> next_edges_;
  std::vector<OutputMeta> outputs_;
  uint64_t sequence_nr_;
  bool mixed_precision_;
};

/** Backward formula: output gradients to exactly one gradient per input. An
 * undefined entry means zero: the op sends that input nothing (an integer
 * input, a src that needs no grad, a custom function's stop-gradient). */
using BackwardFn = std::function<std::vector<Tensor>(const std::vector<Tensor>& grads)>;

/** A node whose backward is a closure; the closure is dropped on release. An
 * empty closure is an op without a gradient rule: reaching it in backward
 * throws "[op] has no gradient rule". */
class FunctionNode final : public Node {
 public:
  FunctionNode(std::string name, std::vector<Edge> next, std::vector<OutputMeta> outputs,
               BackwardFn fn);
  std::vector<Tensor> apply(const std::vector<Tensor>& grad_outputs) override;
  void release() override { fn_ = nullptr; }
  bool released() const override { return !fn_; }

 private:
  BackwardFn fn_;
};

/** Sink node of a leaf: adds the incoming gradient into `.grad`, then runs
 * the leaf's post-accumulate hooks. */
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<TensorImpl> leaf);
  std::vector<Tensor> apply(const std::vector<Tensor>& grad_outputs) override;

 private:
  std::shared_ptr<TensorImpl> leaf_;
};

namespace autograd {

/** True when grad mode is on and some input requires grad. */
bool any_requires_grad(const std::vector<Tensor>& inputs);
/** The edge through which a gradient reaches `t` (null node if none). */
Edge edge_of(const Tensor& t);

/** Attaches a backward node to `out` if any input needs a gradient; the
 * closure receives the gradient of `out` and returns one gradient per input
 * (undefined = zero, see BackwardFn). An empty closure records an op without
 * a gradient rule, which fails naming `op` only if backward reaches it.
 * Returns `out`. This is how single-output ops record. */
Tensor record(const char* op, Tensor out, const std::vector<Tensor>& inputs,
              std::function<std::vector<Tensor>(const Tensor& grad)> backward);

/** Multi-output form of `record`: missing output gradients arrive as zeros. */
std::vector<Tensor> record(const char* op, std::vector<Tensor> outs,
                           const std::vector<Tensor>& inputs, BackwardFn backward);

/** True when `t` is the only handle on its storage, is contiguous and
 * spans the whole buffer: nothing else can see its values (no other handle,
 * no closure that kept it), so an op handed it may write its result there. */
bool sole_storage(const Tensor& t);

/** sole_storage(t) for a tensor outside the graph: a gradient the engine
 * made, so the engine may add into it in place or adopt it as a leaf's .grad
 * instead of copying (one pass and one allocation fewer per accumulation). */
bool sole_owner(const Tensor& t);

/** Inside a backward formula: the sum of the gradients that already reached
 * the node's input `input` (its index among the inputs the op was recorded
 * with), when the engine can hand it over (nothing else holds it; it is
 * contiguous) and it has the given shape, dtype and device; else undefined
 * (always, outside a formula). A formula may add its gradient for that input
 * into this tensor and return it as that input's gradient: the engine then
 * adds nothing. A tensor read by several ops (a LoRA layer's input reaches
 * six products) then gets its gradient summed where each product writes,
 * instead of in a fresh buffer per consumer and a pass to add each. */
Tensor gradient_sink(size_t input, const Shape& shape, DType dtype, Device device);

/** Where a formula writes input `input`'s gradient: the offered sum
 * (gradient_sink; `add`: add onto it) or else a fresh, uninitialised tensor
 * of that shape, dtype and device (write it). */
struct GradientBuffer {
  Tensor tensor;
  bool add = false;
};
GradientBuffer gradient_buffer(size_t input, const Shape& shape, DType dtype, Device device);

/** Runs reverse mode from `roots` with seed gradients `grads` (undefined
 * entries allowed for one-element roots). */
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
              bool retain_graph = false);

/** Gradients of `outputs` with respect to `inputs` (not accumulated into
 * .grad). Inputs that do not influence the outputs get undefined tensors. */
std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_outputs = {}, bool retain_graph = false);

}  // namespace autograd
}  // namespace quanta
