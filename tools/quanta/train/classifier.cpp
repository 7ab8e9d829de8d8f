#include "train/classifier.h"

#include <cmath>
#include <limits>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/reduce.h"
#include "engine/ops/reductions.h"
#include "engine/ops/view.h"

namespace quanta::train {

std::shared_ptr<Sequential> make_classifier(const ClassifierShape& shape, Generator& gen) {
  constexpr int64_t kPixels = 28 * 28;
  return std::make_shared<Sequential>(
      std::make_shared<Flatten>(), std::make_shared<Linear>(kPixels, shape.hidden1, gen),
      std::make_shared<ReLU>(), std::make_shared<Linear>(shape.hidden1, shape.hidden2, gen),
      std::make_shared<ReLU>(), std::make_shared<Linear>(shape.hidden2, kNumClasses, gen));
}

double accuracy(Module& model, const Tensor& images, const Tensor& labels, int64_t batch) {
  const int64_t n = images.size(0);
  if (n == 0) return std::numeric_limits<double>::quiet_NaN();
  // Batches go to the model's device, and the count stays there until the
  // one read at the end.
  const std::vector<Tensor> params = model.parameters();
  const Device device = params.empty() ? Device::cpu() : params.front().device();
  EvalModeGuard eval_mode(model);
  NoGradGuard no_grad;
  Tensor correct = zeros({}, {.dtype = DType::i64, .device = device});
  for (int64_t i = 0; i < n; i += batch) {
    const int64_t b = std::min(batch, n - i);
    const Tensor pred = argmax(model.forward(images.narrow(0, i, b).to(device)), 1);
    const Tensor hits = eq(pred, labels.narrow(0, i, b).to(device));
    correct = correct + sum(to_dtype(hits, DType::i64));
  }
  return correct.item() / double(n);
}

}  // namespace quanta::train
