#include "engine/autograd/grad_mode.h"

namespace quanta {
namespace {
thread_local bool t_grad_enabled = true;
thread_local bool t_inference = false;
}  // namespace

bool grad_enabled() { return t_grad_enabled; }
bool inference_mode() { return t_inference; }

NoGradGuard::NoGradGuard() : prev_(t_grad_enabled) { t_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { t_grad_enabled = prev_; }

InferenceGuard::InferenceGuard() : prev_grad_(t_grad_enabled), prev_inference_(t_inference) {
  t_grad_enabled = false;
  t_inference = true;
}
InferenceGuard::~InferenceGuard() {
  t_grad_enabled = prev_grad_;
  t_inference = prev_inference_;
}

EnableGradGuard::EnableGradGuard() : prev_(t_grad_enabled) { t_grad_enabled = true; }
EnableGradGuard::~EnableGradGuard() { t_grad_enabled = prev_; }

}  // namespace quanta
