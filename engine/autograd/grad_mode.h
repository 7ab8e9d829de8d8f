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

/** True while recompute (engine/nn/recompute.h) runs its function again in
 * the backward to rebuild the graph: what the function returns is then
 * differentiated, never read (its value was kept from the forward). */
bool recomputing();

/** True inside an UnreadOutputGuard: see there. */
bool output_unread();

/** Marks this thread as recomputing (recompute's backward) for its lifetime. */
class RecomputingGuard {
 public:
  RecomputingGuard();
  ~RecomputingGuard();
  RecomputingGuard(const RecomputingGuard&) = delete;
  RecomputingGuard& operator=(const RecomputingGuard&) = delete;

 private:
  bool prev_;
};

/** When `on`, marks the outputs made on this thread for its lifetime as
 * never read, only differentiated through: ops that honour it (the NF4
 * products) write zeros instead of computing an output their backward does
 * not read either. A decoder layer's last product when recomputed is one:
 * the layer's output, the next layer's input, was kept from the forward. */
class UnreadOutputGuard {
 public:
  explicit UnreadOutputGuard(bool on = true);
  ~UnreadOutputGuard();
  UnreadOutputGuard(const UnreadOutputGuard&) = delete;
  UnreadOutputGuard& operator=(const UnreadOutputGuard&) = delete;

 private:
  bool prev_;
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
