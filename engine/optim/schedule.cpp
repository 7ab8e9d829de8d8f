// Learning-rate schedules over an optimizer's parameter groups.
#include "engine/optim/schedule.h"

#include <cmath>
#include <numbers>
#include <stdexcept>
#include <string>
#include <unordered_set>

#include "engine/factory.h"

namespace quanta {

LrSchedule::LrSchedule(const char* name, Optimizer& optimizer) : name_(name), opt_(optimizer) {
  for (const ParamGroup& g : opt_.param_groups()) base_lrs_.push_back(*g.lr);
}

void LrSchedule::fail(const std::string& what) const {
  throw std::invalid_argument("[" + name_ + "] " + what);
}

void LrSchedule::apply() {
  auto& groups = opt_.param_groups();
  if (groups.size() != base_lrs_.size())
    fail("the optimizer has " + std::to_string(groups.size()) +
         " parameter groups, the schedule was made for " + std::to_string(base_lrs_.size()));
  for (size_t g = 0; g < groups.size(); ++g) groups[g].lr = lr_at(step_, g);
}

void LrSchedule::step() {
  ++step_;
  apply();
}

StateDict LrSchedule::state_dict() const {
  StateDict sd;
  sd.emplace_back("step", scalar(static_cast<double>(step_), {.dtype = DType::i64}));
  for (size_t g = 0; g < base_lrs_.size(); ++g)
    sd.emplace_back("base_lrs." + std::to_string(g), scalar(base_lrs_[g], {.dtype = DType::f64}));
  return sd;
}

void LrSchedule::load_state_dict(const StateDict& sd) {
  std::vector<std::string> missing, unexpected, mismatched;
  std::unordered_set<std::string> known;
  auto take = [&](const std::string& key, double& out) {
    known.insert(key);
    const Tensor* t = find_tensor(sd, key);
    if (!t) {
      missing.push_back(key);
    } else if (!t->defined() || t->dim() != 0) {
      mismatched.push_back(key + " (expected a 0-d tensor)");
    } else {
      out = t->item();
    }
  };
  double step = 0;
  take("step", step);
  if (!(step >= 0) || std::floor(step) != step)
    mismatched.push_back("step (expected a non-negative integer)");
  std::vector<double> base(base_lrs_.size());
  for (size_t g = 0; g < base.size(); ++g) {
    take("base_lrs." + std::to_string(g), base[g]);
    if (!(base[g] >= 0)) mismatched.push_back("base_lrs." + std::to_string(g) + " (negative)");
  }
  for (const auto& [k, v] : sd)
    if (!known.count(k)) unexpected.push_back(k);
  std::string msg;
  auto add = [&](const char* what, const std::vector<std::string>& keys) {
    if (keys.empty()) return;
    msg += std::string(msg.empty() ? "" : "; ") + what;
    for (size_t i = 0; i < keys.size(); ++i) msg += (i ? ", " : "") + keys[i];
  };
  add("missing keys: ", missing);
  add("unexpected keys: ", unexpected);
  add("mismatched keys: ", mismatched);
  if (!msg.empty()) throw std::invalid_argument("[" + name_ + "::load_state_dict] " + msg);
  step_ = static_cast<int64_t>(step);
  base_lrs_ = base;
  apply();
}

// ---- WarmupDecay, WarmupCosine, WarmupLinearDecay ----
WarmupDecay::WarmupDecay(const char* name, Optimizer& optimizer, int64_t warmup_steps,
                         int64_t total_steps, double min_lr)
    : LrSchedule(name, optimizer), warmup_(warmup_steps), total_(total_steps), min_lr_(min_lr) {
  if (warmup_steps < 0 || total_steps < warmup_steps)
    fail("needs 0 <= warmup_steps <= total_steps, got warmup_steps " +
         std::to_string(warmup_steps) + " and total_steps " + std::to_string(total_steps));
  if (!(min_lr >= 0)) fail("min_lr must be >= 0");
}

double WarmupDecay::lr_at(int64_t step, size_t group) const {
  const double base = base_lrs_.at(group);
  if (step < warmup_) return base * static_cast<double>(step + 1) / static_cast<double>(warmup_);
  if (step >= total_) return min_lr_;
  return min_lr_ + (base - min_lr_) * remaining(step);
}

WarmupCosine::WarmupCosine(Optimizer& optimizer, int64_t warmup_steps, int64_t total_steps,
                           double min_lr)
    : WarmupDecay("WarmupCosine", optimizer, warmup_steps, total_steps, min_lr) {
  apply();
}

double WarmupCosine::remaining(int64_t step) const {
  const double p = static_cast<double>(step - warmup_) / static_cast<double>(total_ - warmup_);
  return 0.5 * (1.0 + std::cos(std::numbers::pi * p));
}

WarmupLinearDecay::WarmupLinearDecay(Optimizer& optimizer, int64_t warmup_steps,
                                     int64_t total_steps, double min_lr)
    : WarmupDecay("WarmupLinearDecay", optimizer, warmup_steps, total_steps, min_lr) {
  apply();
}

double WarmupLinearDecay::remaining(int64_t step) const {
  return static_cast<double>(total_ - step) / static_cast<double>(total_ - warmup_);
}

// ---- LinearWarmup ----
LinearWarmup::LinearWarmup(Optimizer& optimizer, int64_t warmup_steps)
    : LrSchedule("LinearWarmup", optimizer), warmup_(warmup_steps) {
  if (warmup_steps < 0) fail("warmup_steps must be >= 0, got " + std::to_string(warmup_steps));
  apply();
}

double LinearWarmup::lr_at(int64_t step, size_t group) const {
  const double base = base_lrs_.at(group);
  if (step < warmup_) return base * static_cast<double>(step + 1) / static_cast<double>(warmup_);
  return base;
}

}  // namespace quanta
