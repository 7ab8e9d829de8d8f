#include "train/classifier.h"

#include <cmath>
#include <limits>

#include "engine/autograd/grad_mode.h"
#include "engine/ops/reductions.h"

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
  const bool was_training = model.is_training();
  model.eval();
  NoGradGuard no_grad;
  int64_t correct = 0;
  for (int64_t i = 0; i < n; i += batch) {
    const int64_t b = std::min(batch, n - i);
    const Tensor pred = argmax(model.forward(images.narrow(0, i, b)), 1).contiguous();
    const Tensor want = labels.narrow(0, i, b).contiguous();
    for (int64_t k = 0; k < b; ++k) correct += pred.data<int64_t>()[k] == want.data<int64_t>()[k];
  }
  model.train(was_training);
  return double(correct) / double(n);
}

}  // namespace quanta::train
