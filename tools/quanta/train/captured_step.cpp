#include "train/captured_step.h"

#include <stdexcept>
#include <utility>

#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/random/generator.h"

namespace quanta::train {

namespace {
std::vector<Tensor> on(Device device, const std::vector<Tensor>& host) {
  std::vector<Tensor> out;
  for (const Tensor& t : host) out.push_back(t.to(device));
  return out;
}
}  // namespace

CapturedStep::CapturedStep(Device device, int64_t warmup) : device_(device), warmup_(warmup) {}

bool CapturedStep::fits(const std::vector<Tensor>& host_inputs) const {
  if (host_inputs.size() != inputs_.size()) return false;
  for (std::size_t i = 0; i < inputs_.size(); ++i)
    if (host_inputs[i].shape() != inputs_[i].shape() ||
        host_inputs[i].dtype() != inputs_[i].dtype())
      return false;
  return true;
}

Tensor CapturedStep::run(const std::vector<Tensor>& host_inputs,
                         const std::function<Tensor(const std::vector<Tensor>&)>& body,
                         const std::function<void()>& update, const std::function<void()>& after,
                         Optimizer& optimizer) {
  if (graph_ && fits(host_inputs)) {
    for (std::size_t i = 0; i < inputs_.size(); ++i) copy_(inputs_[i], host_inputs[i]);
    return replay(after);
  }
  // Another shape, or not captured yet: the gradients the graph wrote are
  // zeroed below, so the graph goes.
  if (graph_) {
    short_lived_ = replays_ <= 1 ? short_lived_ + 1 : 0;
    // Three, not two: an epoch's short last batch right after a capture
    // makes two in a row (the full batch's graph, then its own).
    if (short_lived_ >= 3) stopped_ = true;
  }
  graph_.reset();
  if (uncaptured_ < warmup_ || draws_ || stopped_) {
    ++uncaptured_;
    optimizer.zero_grad();
    const uint64_t before = unreplayable_draws_on_this_thread();
    Tensor values = body(on(device_, host_inputs));
    update();
    const uint64_t between = unreplayable_draws_on_this_thread();
    if (after) after();
    // A step that draws for the host (a random level count) or from a
    // stream no layer owns would replay one step's numbers forever: such
    // steps stay uncaptured, and an `after` that does runs outside the
    // graph. k-means' draws in the first update are one step's: the last
    // step before the capture tells. Device draws from a layer's stream
    // replay.
    draws_ = between != before;
    after_draws_ = unreplayable_draws_on_this_thread() != between;
    return values;
  }
  inputs_ = on(device_, host_inputs);
  after_in_graph_ = after && !after_draws_;
  // No gradients before the capture: its backward assigns them, so each
  // replay writes them whole instead of adding to the last step's.
  optimizer.zero_grad();
  try {
    graph_ = DeviceGraph::capture(device_, [&] {
      values_ = body(inputs_);
      update();
      if (after_in_graph_) after();
    });
  } catch (const std::exception& e) {
    // The steps before still run on the device: let them finish while the
    // process is whole (at exit, the libraries their kernels call are gone).
    try {
      synchronize(device_);
    } catch (...) {  // the capture's failure is the one to report
    }
    throw std::runtime_error(std::string("the training step cannot run as a graph on ") +
                             device_.str() + ": " + e.what() + "\n(run with --no-graph)");
  }
  ++captures_;
  replays_ = 0;
  return replay(after);  // the captured step itself
}

Tensor CapturedStep::replay(const std::function<void()>& after) {
  graph_->replay();
  ++replays_;
  if (after && !after_in_graph_) after();
  return values_.clone();  // the next replay rewrites values_
}

}  // namespace quanta::train
