#pragma once
// Optimisers with PyTorch's update rules (torch.optim, single-tensor path)
// and gradient clipping. Updates run in place under NoGradGuard; parameters
// whose .grad is undefined are skipped (their state and step count stay as
// they are).
//
// state_dict() layout (every value a tensor, so io can save it to
// safetensors; g = group index, i = index of the parameter in its group):
//   groups.{g}.lr, groups.{g}.weight_decay     f64 0-d
//   groups.{g}.num_params                      i64 0-d
//   hparams.{name}                             f64 0-d: momentum, dampening,
//                                              nesterov (0/1) for SGD; beta1,
//                                              beta2, eps, amsgrad (0/1) for Adam
//   state.{g}.{i}.step                         i64 0-d, for parameters that
//                                              have been updated at least once
//   state.{g}.{i}.{buffer}                     the parameter's shape and dtype:
//                                              momentum_buffer (SGD), exp_avg,
//                                              exp_avg_sq, max_exp_avg_sq (Adam)
// The values are views of the live state: clone them for a snapshot.
#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/nn/module.h"
#include "engine/tensor.h"

namespace quanta {

struct AdamStep;  // engine/kernels/table.h

/** Parameters that share a learning rate and weight decay. Unset values take
 * the optimiser's defaults. */
struct ParamGroup {
  std::vector<Tensor> params;
  std::optional<double> lr = std::nullopt;
  std::optional<double> weight_decay = std::nullopt;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /** One update of every parameter that has a gradient. Inside a capture
   * (engine/capture/device_graph.h) each replay is one more step: the step
   * counts advance and the kernels read each group's lr and weight decay as
   * they are when replay() is called (set_lr before it). Captured, every
   * parameter with a gradient must be f32 or f64, contiguous, and stepped
   * before (its state exists); the optimizer must outlive the graph. */
  void step();
  /** Drops the gradients of all parameters (sets them undefined). */
  void zero_grad();

  /** The learning rate of group 0. */
  double lr() const;
  /** Sets the learning rate of every group. */
  void set_lr(double lr);
  /** The groups (lr and weight_decay are always set after construction). */
  std::vector<ParamGroup>& param_groups() { return groups_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  /** Adds a group (unset values take the defaults); its parameters must not
   * already be in another group. */
  void add_param_group(ParamGroup group);

  /** Hyper-parameters, group settings and per-parameter state, named as in
   * the layout at the top of this file. */
  StateDict state_dict() const;
  /** Restores what state_dict() returned (values are copied, onto each
   * parameter's device and dtype). Checks everything first; the error names
   * every missing, unexpected and mis-shaped key. */
  void load_state_dict(const StateDict& sd);

 protected:
  /** The state of one parameter: update count and named buffers. */
  struct ParamState {
    int64_t step = 0;
    std::vector<std::pair<std::string, Tensor>> buffers;
    /** The buffer `name`, or an undefined tensor. */
    Tensor get(const std::string& name) const;
    void set(const std::string& name, const Tensor& t);
  };
  /** A hyper-parameter as saved under hparams.{name}. */
  struct HyperParam {
    std::string name;
    double* value;
  };

  Optimizer(const char* name, std::vector<ParamGroup> groups, double default_lr,
            double default_weight_decay);
  /** True when p's step can run fused (kernel table's sgd_step/adam_step):
   * f32/f64, contiguous, gradient and buffers alike (optimizer.cpp). */
  static bool fusable(const Tensor& p, const Tensor& grad, const ParamState& st);
  /** Updates `p` in place from `grad` (defined); runs under NoGradGuard with
   * st.step already incremented. */
  virtual void update(const ParamGroup& group, const Tensor& p, const Tensor& grad,
                      ParamState& st) = 0;
  /** Runs what update() queued, after the last parameter of a step (and
   * after a failed one, for those queued before the failure). */
  virtual void finish_step() {}
  /** Inside a capture: throws std::logic_error, naming the parameter, when
   * its step cannot be replayed exactly (no fused step, state the step
   * would create, another device). */
  void check_capturable(const Tensor& p, const Tensor& grad, const ParamState& st) const;
  /** Hyper-parameters other than lr and weight decay (stored as doubles). */
  virtual std::vector<HyperParam> hyper_params() = 0;
  /** Checks the hyper-parameters; throws naming the bad one. */
  virtual void check_hyper_params() const = 0;
  /** Buffers a parameter must have once it has been updated. */
  virtual std::vector<std::string> state_buffers() const = 0;

  [[noreturn]] void fail(const std::string& what) const;
  void check_group(const ParamGroup& g) const;

  std::string name_;
  double default_lr_;
  double default_weight_decay_;
  std::vector<ParamGroup> groups_;
  std::vector<std::vector<ParamState>> state_;  // [group][param]
  /** The group and index of the parameter update() is called for. */
  std::pair<size_t, size_t> stepping_{0, 0};

 private:
  // The steps of load_state_dict (optimizer.cpp): every key is read and
  // checked before anything is applied.
  struct LoadCheck;     // the keys read, and what was missing, unexpected or mis-shaped
  struct GroupValues;   // one group's incoming lr and weight decay
  struct LoadedStates;  // the incoming per-parameter state, by parameter
  std::vector<GroupValues> read_group_values(LoadCheck& check) const;
  /** Sets the incoming hyper-parameters; returns the ones they replaced. */
  std::vector<double> adopt_hyper_params(LoadCheck& check);
  void set_hyper_params(const std::vector<double>& values);
  LoadedStates read_param_states(LoadCheck& check, const std::vector<std::string>& needed) const;
  void check_param_states(LoadCheck& check, const LoadedStates& states,
                          const std::vector<std::string>& needed) const;
  /** Every problem found, "; "-separated; empty when there is none. */
  static std::string describe_problems(const LoadCheck& check,
                                       const std::vector<GroupValues>& groups);
  void apply_loaded(const std::vector<GroupValues>& groups, const LoadedStates& states);
};

/** SGD settings (torch.optim.SGD). */
struct SGDOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  double weight_decay = 0.0;
};

/** Stochastic gradient descent, PyTorch's rule:
 *   g = grad + weight_decay * p
 *   b = g on the first step, else momentum * b + (1 - dampening) * g
 *   g = g + momentum * b with nesterov, else b      (when momentum != 0)
 *   p = p - lr * g */
class SGD : public Optimizer {
 public:
  SGD(const std::vector<Tensor>& params, const SGDOptions& opts = {});
  SGD(std::vector<ParamGroup> groups, const SGDOptions& opts = {});

 protected:
  void update(const ParamGroup& group, const Tensor& p, const Tensor& grad,
              ParamState& st) override;
  std::vector<HyperParam> hyper_params() override;
  void check_hyper_params() const override;
  std::vector<std::string> state_buffers() const override;

 private:
  double momentum_, dampening_, nesterov_;
};

/** Adam settings (torch.optim.Adam). */
struct AdamOptions {
  double lr = 1e-3;
  std::array<double, 2> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool amsgrad = false;
};

/** AdamW settings (torch.optim.AdamW): Adam's, with weight decay 1e-2. */
struct AdamWOptions {
  double lr = 1e-3;
  std::array<double, 2> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool amsgrad = false;
};

/** Adam, PyTorch's rule, with weight decay as L2 (added to the gradient):
 *   g = grad + weight_decay * p
 *   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
 *   vmax = max(vmax, v) with amsgrad (then used in place of v)
 *   p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps) */
class Adam : public Optimizer {
 public:
  Adam(const std::vector<Tensor>& params, const AdamOptions& opts = {});
  Adam(std::vector<ParamGroup> groups, const AdamOptions& opts = {});
  ~Adam() override;

 protected:
  Adam(const char* name, std::vector<ParamGroup> groups, const AdamOptions& opts, bool decoupled);
  void update(const ParamGroup& group, const Tensor& p, const Tensor& grad,
              ParamState& st) override;
  std::vector<HyperParam> hyper_params() override;
  void check_hyper_params() const override;
  std::vector<std::string> state_buffers() const override;
  void finish_step() override;

 private:
  /** The settings of parameter i of group g's step now (its step count
   * already advanced). */
  AdamStep settings(size_t g, size_t i) const;

  double beta1_, beta2_, eps_, amsgrad_;
  bool decoupled_;
  // The step's fusable parameters, run together by finish_step
  // (optimizer.cpp).
  struct Queued;
  std::vector<Queued> queued_;
};

/** AdamW: Adam with decoupled weight decay, p = p (1 - lr weight_decay)
 * before the Adam step (the gradient is not decayed). */
class AdamW : public Adam {
 public:
  AdamW(const std::vector<Tensor>& params, const AdamWOptions& opts = {});
  AdamW(std::vector<ParamGroup> groups, const AdamWOptions& opts = {});
};

/** Scales the gradients of `params` so that their joint `norm_type`-norm (the
 * norm of the per-tensor norms; INFINITY for max |g|) is at most `max_norm`:
 * g *= max_norm / (total + 1e-6) when that is below 1. Parameters without a
 * gradient are ignored. Returns the total norm before clipping. With
 * `error_if_nonfinite` a NaN or infinite total throws instead. */
double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0,
                       bool error_if_nonfinite = false);

/** clip_grad_norm_ without reading the device: returns the total norm as an
 * f64 0-d tensor on the gradients' device (a CPU zero when there are
 * none), so a GPU step does not wait for it and a captured step
 * (engine/capture/device_graph.h) may clip. */
Tensor clip_grad_norm_no_sync_(const std::vector<Tensor>& params, double max_norm,
                               double norm_type = 2.0);

/** The pieces of clip_grad_norm_, for gradients spread over ranks
 * (dist::OptimizerShards): the per-tensor `norm_type`-norms of `grads`
 * (f64, 1-d, empty gradients skipped, on the first one's device)... */
Tensor grad_norms(const std::vector<Tensor>& grads, double norm_type = 2.0);
/** ...and, given every gradient's norm in that order, `grads` scaled as
 * clip_grad_norm_ scales them; returns the total norm. */
double clip_grads_by_norms(const std::vector<Tensor>& grads, const Tensor& norms, double max_norm,
                           double norm_type = 2.0, bool error_if_nonfinite = false);

/** Clamps every gradient of `params` to [-clip_value, clip_value] in place. */
void clip_grad_value_(const std::vector<Tensor>& params, double clip_value);

}  // namespace quanta
