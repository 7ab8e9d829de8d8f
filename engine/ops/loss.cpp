// Losses, composed from log_softmax, gather and reductions so their gradients
// come from those ops; one_hot is a plain kernel.
#include "engine/ops/loss.h"

#include <algorithm>
#include <string>

#include "engine/device_backend.h"
#include "engine/factory.h"
#include "engine/kernels/table.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/reduce.h"
#include "engine/ops/softmax.h"
#include "engine/ops/view.h"

namespace quanta {
namespace {

Tensor reduce_loss(const Tensor& loss, Reduction r) {
  switch (r) {
    case Reduction::none:
      return loss;
    case Reduction::sum:
      return sum(loss);
    case Reduction::mean:
      return mean(loss);
  }
  throw std::invalid_argument("[loss] unknown reduction");
}

void check_pair(const char* op, const Tensor& a, const Tensor& b) {
  kernels_for(op, {&a, &b});  // one device for both
  if (!is_floating(a.dtype()) || !is_floating(b.dtype()))
    throw std::invalid_argument(std::string("[") + op + "] needs floating tensors, got " +
                                dtype_name(a.dtype()) + " and " + dtype_name(b.dtype()));
  // No broadcasting: a [N, 1] prediction against a [N] target is almost
  // always a bug, not an intent.
  if (a.shape() != b.shape())
    throw std::invalid_argument(std::string("[") + op + "] input shape " + shape_str(a.shape()) +
                                " and target shape " + shape_str(b.shape()) + " differ");
}

// Label smoothing: (1 - eps) loss + eps * (mean over classes of -log p).
Tensor smooth(const Tensor& loss, const Tensor& lsm, double eps) {
  if (eps == 0) return loss;
  return add(mul(loss, constant_like(loss, 1.0 - eps)),
             mul(neg(mean(lsm, {1})), constant_like(loss, eps)));
}

Tensor cross_entropy_probs(const Tensor& logits, const Tensor& target, Reduction reduction,
                           double eps) {
  if (target.shape() != logits.shape())
    throw std::invalid_argument("[cross_entropy] probability target shape " +
                                shape_str(target.shape()) + " does not match logits shape " +
                                shape_str(logits.shape()));
  const Tensor lsm = log_softmax(logits, 1);
  return reduce_loss(smooth(neg(sum(mul(target, lsm), {1})), lsm, eps), reduction);
}

}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& target, Reduction reduction,
                     int64_t ignore_index, double label_smoothing) {
  kernels_for("cross_entropy", {&logits, &target});
  if (!is_floating(logits.dtype()))
    throw std::invalid_argument(std::string("[cross_entropy] logits must be floating, got ") +
                                dtype_name(logits.dtype()));
  if (logits.dim() == 0)
    throw std::invalid_argument(
        "[cross_entropy] logits must be [C] or [N, C, ...], got a 0-d tensor");
  if (!(label_smoothing >= 0.0 && label_smoothing <= 1.0))
    throw std::invalid_argument("[cross_entropy] label_smoothing must be in [0, 1], got " +
                                std::to_string(label_smoothing));
  if (logits.dim() == 1) {
    // [C] logits: one sample, with a 0-d class target or a [C] probability target.
    if (!is_floating(target.dtype()) && target.dim() != 0)
      throw std::invalid_argument("[cross_entropy] target shape " + shape_str(target.shape()) +
                                  " does not match logits shape " + shape_str(logits.shape()) +
                                  ": expected []");
    Tensor out = cross_entropy(unsqueeze(logits, 0), unsqueeze(target, 0), reduction, ignore_index,
                               label_smoothing);
    return reduction == Reduction::none ? squeeze(out, 0) : out;
  }
  if (is_floating(target.dtype()))
    return cross_entropy_probs(logits, target, reduction, label_smoothing);
  if (!is_integral(target.dtype()))
    throw std::invalid_argument(std::string("[cross_entropy] target must hold i64 class ") +
                                "indices or floating probabilities, got " +
                                dtype_name(target.dtype()));
  const int64_t classes = logits.shape()[1];
  Shape want = logits.shape();
  want.erase(want.begin() + 1);
  if (target.shape() != want)
    throw std::invalid_argument("[cross_entropy] target shape " + shape_str(target.shape()) +
                                " does not match logits shape " + shape_str(logits.shape()) +
                                ": expected " + shape_str(want));
  const Tensor t = target.detach().to(DType::i64);
  // The CPU's targets are checked here, at once; a device checks its own
  // (the picked classes below) without the host reading them.
  const bool on_host = device_caps(t.device()).host_readable;
  if (on_host)
    for (int64_t v : t.to_vector<int64_t>())
      if (v != ignore_index && (v < 0 || v >= classes))
        throw std::invalid_argument("[cross_entropy] target " + std::to_string(v) +
                                    " is out of range for " + std::to_string(classes) +
                                    " classes (ignore_index " + std::to_string(ignore_index) + ")");

  const TensorOptions index_opts{.dtype = DType::i64, .device = t.device()};
  const Tensor keep = ne(t, shared_full({}, static_cast<double>(ignore_index), index_opts));
  // Ignored targets pick class 0 (any valid class) and are masked out below.
  Tensor picked = where(keep, t, shared_full({}, 0.0, index_opts));
  if (!on_host) picked = detail::checked_index("cross_entropy", contiguous(picked), 1, classes);
  const Tensor lsm = log_softmax(logits, 1);                            // [N, C, *]
  Tensor loss = neg(squeeze(gather(lsm, 1, unsqueeze(picked, 1)), 1));  // [N, *]
  loss = smooth(loss, lsm, label_smoothing);
  loss = where(keep, loss, constant_like(loss, 0.0));
  if (reduction != Reduction::mean) return reduce_loss(loss, reduction);
  // Mean over the targets that count; 0 / 0 = NaN when all are ignored.
  return div(sum(loss), to_dtype(sum(keep), loss.dtype()));
}

Tensor mse_loss(const Tensor& a, const Tensor& b, Reduction reduction) {
  check_pair("mse_loss", a, b);
  return reduce_loss(square(sub(a, b)), reduction);
}

Tensor l1_loss(const Tensor& a, const Tensor& b, Reduction reduction) {
  check_pair("l1_loss", a, b);
  return reduce_loss(abs(sub(a, b)), reduction);
}

Tensor one_hot(const Tensor& indices, int64_t num_classes) {
  if (!is_integral(indices.dtype()))
    throw std::invalid_argument(std::string("[one_hot] indices must be integers, got ") +
                                dtype_name(indices.dtype()));
  if (num_classes < -1)
    throw std::invalid_argument("[one_hot] num_classes must be >= 0 or -1, got " +
                                std::to_string(num_classes));
  const std::vector<int64_t> idx = indices.to_vector<int64_t>();
  if (num_classes == -1) {
    if (idx.empty())
      throw std::invalid_argument(
          "[one_hot] cannot infer num_classes from an empty tensor: pass num_classes");
    num_classes = *std::max_element(idx.begin(), idx.end()) + 1;
  }
  for (int64_t v : idx)
    if (v < 0 || v >= num_classes)
      throw std::invalid_argument("[one_hot] index " + std::to_string(v) + " is out of range for " +
                                  std::to_string(num_classes) + " classes");
  Shape shape = indices.shape();
  shape.push_back(num_classes);
  // Built on the host from the checked values (one pass, no kernel worth a
  // family of its own), then placed on the indices' device.
  Tensor out = zeros(shape, {.dtype = DType::i64});
  int64_t* o = out.data<int64_t>();
  for (size_t i = 0; i < idx.size(); ++i) o[static_cast<int64_t>(i) * num_classes + idx[i]] = 1;
  return out.to(indices.device());
}

}  // namespace quanta
