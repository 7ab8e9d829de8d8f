#include "engine/autograd/grad_mode.h"

namespace quanta {
namespace {
thread_local bool t_grad_enabled = true;
thread_local bool t_inference = false;
thread_local bool t_recomputing = false;
thread_local bool t_output_unread = false;
}  // namespace

bool grad_enabled() { return t_grad_enabled; }
bool inference_mode() { return t_inference; }
bool recomputing() { return t_recomputing; }
bool output_unread() { return t_output_unread; }

RecomputingGuard::RecomputingGuard() : prev_(t_recomputing) { t_recomputing = true; }
RecomputingGuard::~RecomputingGuard() { t_recomputing = prev_; }

UnreadOutputGuard::UnreadOutputGuard(bool on) : prev_(t_output_unread) {
  t_output_unread = prev_ || on;
}
UnreadOutputGuard::~UnreadOutputGuard() { t_output_unread = prev_; }

ReadOutputGuard::ReadOutputGuard() : prev_(t_output_unread) { t_output_unread = false; }
ReadOutputGuard::~ReadOutputGuard() { t_output_unread = prev_; }

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
