#pragma once
// Thread-local switches for autograd: the only mutable global state in the
// engine besides the thread count.

namespace quanta {

/** True unless a NoGradGuard or InferenceGuard is active on this thread. */
bool grad_enabled();
/** True while an InferenceGuard is active on this thread. */
bool inference_mode();

/** Disables graph recording on this thread for its lifetime. */
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

/** Like NoGradGuard, and also marks the thread as running inference (layers
 * may skip training-only bookkeeping). */
class InferenceGuard {
 public:
  InferenceGuard();
  ~InferenceGuard();
  InferenceGuard(const InferenceGuard&) = delete;
  InferenceGuard& operator=(const InferenceGuard&) = delete;

 private:
  bool prev_grad_;
  bool prev_inference_;
};

/** Re-enables graph recording inside a no-grad region. */
class EnableGradGuard {
 public:
  EnableGradGuard();
  ~EnableGradGuard();
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool prev_;
};

}  // namespace quanta
