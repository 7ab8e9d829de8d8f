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

/** True inside an UnreadOutputGuard that is on: see there. */
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

/** When `on`, says of the module calls made on this thread for its lifetime
 * that their outputs are never read, only added onto and differentiated
 * through: a decoder layer's last projection when the layer is recomputed
 * (its output, the next layer's input, was kept from the forward). Modules
 * that can then skip computing their output: an NF4 layer's frozen product
 * gives zeros (nf4_linear), its backward unchanged since it never reads the
 * output. Other ops ignore it: an output some backward reads (a LoRA
 * adapter's rank-r activation) is computed as always. */
class UnreadOutputGuard {
 public:
  explicit UnreadOutputGuard(bool on = true);
  ~UnreadOutputGuard();
  UnreadOutputGuard(const UnreadOutputGuard&) = delete;
  UnreadOutputGuard& operator=(const UnreadOutputGuard&) = delete;

 private:
  bool prev_;
};

/** Undoes UnreadOutputGuard for the module calls made on this thread for its
 * lifetime: a module whose own output goes unread may still read what its
 * inner calls return (DoRA scales its frozen product's output). */
class ReadOutputGuard {
 public:
  ReadOutputGuard();
  ~ReadOutputGuard();
  ReadOutputGuard(const ReadOutputGuard&) = delete;
  ReadOutputGuard& operator=(const ReadOutputGuard&) = delete;

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
