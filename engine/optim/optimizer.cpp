// Optimizer base: groups, stepping, state dicts; SGD, Adam, AdamW; clipping.
#include "engine/optim/optimizer.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>
#include <sstream>
#include <stdexcept>
#include <unordered_set>

#include "engine/autograd/grad_mode.h"
#include "engine/capture/device_graph.h"
#include "engine/factory.h"
#include "engine/kernels/table.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/join.h"
#include "engine/ops/reductions.h"
#include "engine/text.h"

namespace quanta {
namespace {

std::string num(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

Tensor f64_scalar(double v) { return scalar(v, {.dtype = DType::f64}); }

bool parse_index(std::string_view s, size_t& out) {
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && p == s.data() + s.size();
}

}  // namespace

// ---- ParamState ----
Tensor Optimizer::ParamState::get(const std::string& name) const {
  for (const auto& [k, v] : buffers)
    if (k == name) return v;
  return Tensor();
}

void Optimizer::ParamState::set(const std::string& name, const Tensor& t) {
  for (auto& [k, v] : buffers)
    if (k == name) {
      v = t;
      return;
    }
  buffers.emplace_back(name, t);
}

// ---- Optimizer ----
Optimizer::Optimizer(const char* name, std::vector<ParamGroup> groups, double default_lr,
                     double default_weight_decay)
    : name_(name), default_lr_(default_lr), default_weight_decay_(default_weight_decay) {
  if (!(default_lr >= 0)) fail("lr must be >= 0, got " + num(default_lr));
  if (!(default_weight_decay >= 0))
    fail("weight_decay must be >= 0, got " + num(default_weight_decay));
  if (groups.empty()) fail("no parameter groups given");
  for (auto& g : groups) add_param_group(std::move(g));
}

void Optimizer::fail(const std::string& what) const {
  throw std::invalid_argument("[" + name_ + "] " + what);
}

void Optimizer::check_group(const ParamGroup& g) const {
  if (!(*g.lr >= 0)) fail("lr must be >= 0, got " + num(*g.lr));
  if (!(*g.weight_decay >= 0)) fail("weight_decay must be >= 0, got " + num(*g.weight_decay));
  std::unordered_set<const TensorImpl*> seen;
  for (const auto& grp : groups_)
    for (const Tensor& p : grp.params) seen.insert(p.impl());
  for (size_t i = 0; i < g.params.size(); ++i) {
    const Tensor& p = g.params[i];
    const std::string where =
        "parameter " + std::to_string(i) + " of group " + std::to_string(groups_.size());
    if (!p.defined()) fail(where + " is undefined");
    if (!is_floating(p.dtype()))
      fail(where + " has dtype " + dtype_name(p.dtype()) + ", expected a floating dtype");
    if (!p.is_leaf()) fail(where + " is not a leaf (optimisers update leaves in place)");
    if (!seen.insert(p.impl()).second)
      fail(where + " appears more than once in the parameter groups");
  }
}

void Optimizer::add_param_group(ParamGroup group) {
  if (!group.lr) group.lr = default_lr_;
  if (!group.weight_decay) group.weight_decay = default_weight_decay_;
  check_group(group);
  state_.emplace_back(group.params.size());
  groups_.push_back(std::move(group));
}

void Optimizer::step() {
  NoGradGuard no_grad;
  if (capture_open()) {
    // Each replay of a captured step is one more step: the step counts
    // advance on the host as they would (the bias corrections read them).
    std::vector<std::pair<size_t, size_t>> stepped;
    for (size_t g = 0; g < groups_.size(); ++g)
      for (size_t i = 0; i < groups_[g].params.size(); ++i)
        if (groups_[g].params[i].grad().defined()) stepped.emplace_back(g, i);
    on_replay([this, stepped] {
      for (const auto& [g, i] : stepped) ++state_[g][i].step;
    });
  }
  try {
    for (size_t g = 0; g < groups_.size(); ++g) {
      for (size_t i = 0; i < groups_[g].params.size(); ++i) {
        const Tensor& p = groups_[g].params[i];
        const Tensor grad = p.grad();
        if (!grad.defined()) continue;
        ParamState& st = state_[g][i];
        ++st.step;
        stepping_ = {g, i};
        if (capture_open()) check_capturable(p, grad, st);
        update(groups_[g], p, grad, st);
      }
    }
  } catch (...) {
    // The parameters updated before the failure keep their step, as they
    // would one by one: the queued ones too.
    try {
      finish_step();
    } catch (...) {
    }
    throw;
  }
  finish_step();
}

void Optimizer::zero_grad() {
  for (const auto& g : groups_)
    for (const Tensor& p : g.params) p.zero_grad();
}

double Optimizer::lr() const { return *groups_.at(0).lr; }

void Optimizer::set_lr(double lr) {
  if (!(lr >= 0)) fail("lr must be >= 0, got " + num(lr));
  for (auto& g : groups_) g.lr = lr;
}

StateDict Optimizer::state_dict() const {
  StateDict sd;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const std::string pre = "groups." + std::to_string(g) + ".";
    sd.emplace_back(pre + "lr", f64_scalar(*groups_[g].lr));
    sd.emplace_back(pre + "weight_decay", f64_scalar(*groups_[g].weight_decay));
    sd.emplace_back(pre + "num_params",
                    scalar(static_cast<double>(groups_[g].params.size()), {.dtype = DType::i64}));
  }
  for (const HyperParam& h : const_cast<Optimizer*>(this)->hyper_params())
    sd.emplace_back("hparams." + h.name, f64_scalar(*h.value));
  for (size_t g = 0; g < groups_.size(); ++g)
    for (size_t i = 0; i < groups_[g].params.size(); ++i) {
      const ParamState& st = state_[g][i];
      if (st.step == 0) continue;
      const std::string pre = "state." + std::to_string(g) + "." + std::to_string(i) + ".";
      sd.emplace_back(pre + "step", scalar(static_cast<double>(st.step), {.dtype = DType::i64}));
      for (const auto& [k, v] : st.buffers) sd.emplace_back(pre + k, v.detach());
    }
  return sd;
}

// ---- load_state_dict: read and check everything, then apply ----

// The keys read so far and what was wrong with them, collected so that one
// error names every missing, unexpected and mis-shaped key.
struct Optimizer::LoadCheck {
  explicit LoadCheck(const StateDict& sd) : sd(sd) {}
  const StateDict& sd;
  std::vector<std::string> missing, unexpected, mismatched;
  std::unordered_set<std::string> used;  // keys read as settings, not state

  // The 0-d tensor at `key`, or null (noted as missing or mismatched).
  const Tensor* take(const std::string& key) {
    const Tensor* t = find_tensor(sd, key);
    if (!t) {
      missing.push_back(key);
      return nullptr;
    }
    used.insert(key);
    if (!t->defined() || t->dim() != 0) {
      mismatched.push_back(key + " (expected a 0-d tensor, got " +
                           (t->defined() ? shape_str(t->shape()) : "undefined") + ")");
      return nullptr;
    }
    return t;
  }
};

struct Optimizer::GroupValues {
  double lr = 0, weight_decay = 0;
};

// The state.{g}.{i}.{name} entries, by parameter in (g, i) order.
struct Optimizer::LoadedStates {
  std::map<std::pair<size_t, size_t>, std::vector<std::pair<std::string, const Tensor*>>> by_param;
};

namespace {

// Splits "state.{g}.{i}.{name}"; false when `key` does not have that form.
bool split_state_key(std::string_view key, size_t& g, size_t& i, std::string& name) {
  if (key.substr(0, 6) != "state.") return false;
  key.remove_prefix(6);
  const size_t d1 = key.find('.');
  const size_t d2 = d1 == std::string_view::npos ? d1 : key.find('.', d1 + 1);
  if (d2 == std::string_view::npos || !parse_index(key.substr(0, d1), g) ||
      !parse_index(key.substr(d1 + 1, d2 - d1 - 1), i))
    return false;
  name = std::string(key.substr(d2 + 1));
  return true;
}

}  // namespace

void Optimizer::load_state_dict(const StateDict& sd) {
  LoadCheck check(sd);
  const std::vector<GroupValues> groups = read_group_values(check);
  // The buffers a parameter needs depend on the incoming hyper-parameters:
  // they are set now, and set back when anything turns out wrong.
  const std::vector<double> previous = adopt_hyper_params(check);
  std::vector<std::string> needed;
  try {
    check_hyper_params();
    needed = state_buffers();
  } catch (...) {
    set_hyper_params(previous);
    throw;
  }
  const LoadedStates states = read_param_states(check, needed);
  check_param_states(check, states, needed);
  const std::string problems = describe_problems(check, groups);
  if (!problems.empty()) {
    set_hyper_params(previous);
    throw std::invalid_argument("[" + name_ + "::load_state_dict] " + problems);
  }
  apply_loaded(groups, states);
}

std::vector<Optimizer::GroupValues> Optimizer::read_group_values(LoadCheck& check) const {
  std::vector<GroupValues> values(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    const std::string pre = "groups." + std::to_string(g) + ".";
    const Tensor* lr = check.take(pre + "lr");
    const Tensor* wd = check.take(pre + "weight_decay");
    const Tensor* n = check.take(pre + "num_params");
    if (lr) values[g].lr = lr->item();
    if (wd) values[g].weight_decay = wd->item();
    if (n && n->item() != static_cast<double>(groups_[g].params.size()))
      check.mismatched.push_back(pre + "num_params (expected " +
                                 std::to_string(groups_[g].params.size()) + ", got " +
                                 num(n->item()) + ")");
  }
  return values;
}

std::vector<double> Optimizer::adopt_hyper_params(LoadCheck& check) {
  std::vector<double> previous, incoming;
  for (const HyperParam& h : hyper_params()) {
    previous.push_back(*h.value);
    const Tensor* t = check.take("hparams." + h.name);
    incoming.push_back(t ? t->item() : *h.value);
  }
  set_hyper_params(incoming);
  return previous;
}

void Optimizer::set_hyper_params(const std::vector<double>& values) {
  const std::vector<HyperParam> hps = hyper_params();
  for (size_t k = 0; k < hps.size(); ++k) *hps[k].value = values[k];
}

Optimizer::LoadedStates Optimizer::read_param_states(LoadCheck& check,
                                                     const std::vector<std::string>& needed) const {
  LoadedStates states;
  for (const auto& [key, t] : check.sd) {
    if (check.used.count(key)) continue;
    size_t g = 0, i = 0;
    std::string name;
    bool ok =
        split_state_key(key, g, i, name) && g < groups_.size() && i < groups_[g].params.size();
    if (ok) {
      ok = name == "step";
      for (const auto& n : needed) ok = ok || n == name;
      if (ok) states.by_param[{g, i}].emplace_back(name, &t);
    }
    if (!ok) check.unexpected.push_back(key);
  }
  return states;
}

void Optimizer::check_param_states(LoadCheck& check, const LoadedStates& states,
                                   const std::vector<std::string>& needed) const {
  for (const auto& [gi, list] : states.by_param) {
    const std::string pre =
        "state." + std::to_string(gi.first) + "." + std::to_string(gi.second) + ".";
    const Tensor& p = groups_[gi.first].params[gi.second];
    std::unordered_set<std::string> have;
    for (const auto& [name, t] : list) {
      have.insert(name);
      if (name == "step") {
        if (!t->defined() || t->dim() != 0 || !is_integral(t->dtype()) || t->item() < 1)
          check.mismatched.push_back(pre + "step (expected a positive 0-d integer tensor)");
      } else if (!t->defined() || t->shape() != p.shape() || !is_floating(t->dtype())) {
        check.mismatched.push_back(
            pre + name + " (expected " + shape_str(p.shape()) + " floating, got " +
            (t->defined() ? shape_str(t->shape()) + " " + dtype_name(t->dtype())
                          : std::string("undefined")) +
            ")");
      }
    }
    for (const std::string& n : needed)
      if (!have.count(n)) check.missing.push_back(pre + n);
    if (!have.count("step")) check.missing.push_back(pre + "step");
  }
}

std::string Optimizer::describe_problems(const LoadCheck& check,
                                         const std::vector<GroupValues>& groups) {
  std::vector<std::string> problems;
  if (!check.missing.empty()) problems.push_back("missing keys: " + join_names(check.missing));
  if (!check.unexpected.empty())
    problems.push_back("unexpected keys: " + join_names(check.unexpected));
  if (!check.mismatched.empty())
    problems.push_back("mismatched keys: " + join_names(check.mismatched));
  // Group values are only worth judging once every key is in order.
  for (size_t g = 0; g < groups.size() && problems.empty(); ++g)
    if (!(groups[g].lr >= 0) || !(groups[g].weight_decay >= 0))
      problems.push_back("group " + std::to_string(g) + " has a negative lr or weight_decay");
  std::string text;
  for (size_t k = 0; k < problems.size(); ++k) text += (k ? "; " : "") + problems[k];
  return text;
}

void Optimizer::apply_loaded(const std::vector<GroupValues>& groups, const LoadedStates& states) {
  NoGradGuard no_grad;
  for (size_t g = 0; g < groups_.size(); ++g) {
    groups_[g].lr = groups[g].lr;
    groups_[g].weight_decay = groups[g].weight_decay;
    for (ParamState& st : state_[g]) st = ParamState();
  }
  for (const auto& [gi, list] : states.by_param) {
    const Tensor& p = groups_[gi.first].params[gi.second];
    ParamState& st = state_[gi.first][gi.second];
    for (const auto& [name, t] : list) {
      if (name == "step")
        st.step = static_cast<int64_t>(t->item());
      else
        st.set(name, t->detach().to(p.device()).to(p.dtype()).clone());
    }
  }
}

// A fused step (the kernel table's sgd_step / adam_step, one pass per
// parameter) takes f32 and f64 parameters that are contiguous, with a
// gradient and buffers of the same dtype, shape, device and layout; anything
// else runs the chain of table ops the fused step equals.
bool Optimizer::fusable(const Tensor& p, const Tensor& grad, const ParamState& st) {
  const auto same = [&](const Tensor& t) {
    return t.dtype() == p.dtype() && t.device() == p.device() && t.shape() == p.shape() &&
           t.is_contiguous();
  };
  if (p.dtype() != DType::f32 && p.dtype() != DType::f64) return false;
  if (!p.is_contiguous() || !same(grad)) return false;
  for (const auto& [name, b] : st.buffers)
    if (b.defined() && !same(b)) return false;
  return true;
}

void Optimizer::check_capturable(const Tensor& p, const Tensor& grad, const ParamState& st) const {
  const std::string which = "[" + name_ + "] parameter " + std::to_string(stepping_.second) +
                            " of group " + std::to_string(stepping_.first);
  if (!capturing(p.device()))
    throw std::logic_error(which + " is on " + p.device().str() +
                           ", not the device being captured");
  if (!fusable(p, grad, st))
    throw std::logic_error(which + " (" + dtype_name(p.dtype()) +
                           (p.is_contiguous() ? "" : ", strided") +
                           ") cannot be stepped in a captured step: only f32 and f64 "
                           "contiguous parameters have a fused step that reads its lr from "
                           "device memory");
  for (const std::string& name : state_buffers())
    if (!st.get(name).defined())
      throw std::logic_error(which + " has no " + name +
                             " yet: its first step makes it, which a replay would redo; "
                             "run a step before capturing");
}

// ---- SGD ----
SGD::SGD(const std::vector<Tensor>& params, const SGDOptions& opts)
    : SGD(std::vector<ParamGroup>{ParamGroup{params, {}, {}}}, opts) {}

SGD::SGD(std::vector<ParamGroup> groups, const SGDOptions& opts)
    : Optimizer("SGD", std::move(groups), opts.lr, opts.weight_decay),
      momentum_(opts.momentum),
      dampening_(opts.dampening),
      nesterov_(opts.nesterov ? 1.0 : 0.0) {
  check_hyper_params();
}

std::vector<Optimizer::HyperParam> SGD::hyper_params() {
  return {{"momentum", &momentum_}, {"dampening", &dampening_}, {"nesterov", &nesterov_}};
}

void SGD::check_hyper_params() const {
  if (!(momentum_ >= 0)) fail("momentum must be >= 0, got " + num(momentum_));
  if (!std::isfinite(dampening_)) fail("dampening must be finite, got " + num(dampening_));
  if (nesterov_ != 0 && nesterov_ != 1) fail("nesterov must be 0 or 1");
  if (nesterov_ != 0 && (momentum_ <= 0 || dampening_ != 0))
    fail("nesterov needs momentum > 0 and dampening 0, got momentum " + num(momentum_) +
         " and dampening " + num(dampening_));
}

std::vector<std::string> SGD::state_buffers() const {
  if (momentum_ == 0) return {};
  return {"momentum_buffer"};
}

void SGD::update(const ParamGroup& group, const Tensor& p, const Tensor& grad, ParamState& st) {
  const double lr = *group.lr, wd = *group.weight_decay;
  if (fusable(p, grad, st)) {
    Tensor buf;
    bool first = false;
    if (momentum_ != 0) {
      buf = st.get("momentum_buffer");
      if (!buf.defined()) {
        buf = empty_like(p);  // the step writes it: the first direction
        first = true;
        st.set("momentum_buffer", buf);
      }
    }
    SgdStep s{lr, wd, momentum_, dampening_, nesterov_ != 0, first};
    if (capturing(p.device()))  // each replay reads the group's lr then
      s.live = detail::replay_values(p.device(), 2, [this, g = stepping_.first](double* v) {
        v[0] = *groups_[g].lr;
        v[1] = *groups_[g].weight_decay;
      });
    kernels(p.device())
        .sgd_step(s, p.dtype(), p.numel(), p.raw_data(), grad.raw_data(),
                  buf.defined() ? buf.raw_data() : nullptr);
    return;
  }
  Tensor d = grad;
  if (wd != 0) {
    d = grad.clone();
    add_(d, p, wd);
  }
  if (momentum_ != 0) {
    Tensor buf = st.get("momentum_buffer");
    if (!buf.defined()) {
      buf = d.clone();
      st.set("momentum_buffer", buf);
    } else {
      mul_(buf, momentum_);
      add_(buf, d, 1.0 - dampening_);
    }
    if (nesterov_ != 0) {
      Tensor n = d.clone();
      add_(n, buf, momentum_);
      d = n;
    } else {
      d = buf;
    }
  }
  add_(p, d, -lr);
}

// ---- Adam / AdamW ----
// grad is held so that its memory outlives the queue (the rest is the
// state's).
struct Adam::Queued {
  Device device;
  DType dtype;
  Tensor grad;
  AdamTensor tensor;
  std::pair<size_t, size_t> index;  // group, parameter
};

AdamStep Adam::settings(size_t g, size_t i) const {
  const double t = static_cast<double>(state_[g][i].step);
  return {.lr = *groups_[g].lr,
          .weight_decay = *groups_[g].weight_decay,
          .beta1 = beta1_,
          .beta2 = beta2_,
          .eps = eps_,
          .bc1 = 1.0 - std::pow(beta1_, t),
          .bc2_sqrt = std::sqrt(1.0 - std::pow(beta2_, t)),
          .decoupled = decoupled_,
          .amsgrad = amsgrad_ != 0};
}

Adam::Adam(const std::vector<Tensor>& params, const AdamOptions& opts)
    : Adam("Adam", std::vector<ParamGroup>{ParamGroup{params, {}, {}}}, opts, false) {}

Adam::Adam(std::vector<ParamGroup> groups, const AdamOptions& opts)
    : Adam("Adam", std::move(groups), opts, false) {}

Adam::Adam(const char* name, std::vector<ParamGroup> groups, const AdamOptions& opts,
           bool decoupled)
    : Optimizer(name, std::move(groups), opts.lr, opts.weight_decay),
      beta1_(opts.betas[0]),
      beta2_(opts.betas[1]),
      eps_(opts.eps),
      amsgrad_(opts.amsgrad ? 1.0 : 0.0),
      decoupled_(decoupled) {
  check_hyper_params();
}

Adam::~Adam() = default;

void Adam::finish_step() {
  // One call per device and dtype, in the parameters' order within each.
  std::vector<Queued> queued;
  queued.swap(queued_);
  std::vector<bool> done(queued.size(), false);
  std::vector<AdamTensor> list;
  std::vector<std::pair<size_t, size_t>> index;
  for (size_t i = 0; i < queued.size(); ++i) {
    if (done[i]) continue;
    list.clear();
    index.clear();
    for (size_t j = i; j < queued.size(); ++j)
      if (!done[j] && queued[j].device == queued[i].device && queued[j].dtype == queued[i].dtype) {
        list.push_back(queued[j].tensor);
        index.push_back(queued[j].index);
        done[j] = true;
      }
    if (capturing(queued[i].device)) {
      // Each replay reads the groups' lr and the step counts then.
      const double* live = detail::replay_values(
          queued[i].device, 4 * static_cast<int64_t>(index.size()), [this, index](double* v) {
            for (const auto& [g, p] : index) {
              const AdamStep s = settings(g, p);
              *v++ = s.lr;
              *v++ = s.weight_decay;
              *v++ = s.bc1;
              *v++ = s.bc2_sqrt;
            }
          });
      for (size_t k = 0; k < list.size(); ++k) list[k].s.live = live + 4 * k;
    }
    kernels(queued[i].device)
        .adam_step(queued[i].dtype, {list.data(), static_cast<int64_t>(list.size())});
  }
}

std::vector<Optimizer::HyperParam> Adam::hyper_params() {
  return {{"beta1", &beta1_}, {"beta2", &beta2_}, {"eps", &eps_}, {"amsgrad", &amsgrad_}};
}

void Adam::check_hyper_params() const {
  if (!(beta1_ >= 0 && beta1_ < 1)) fail("beta1 must be in [0, 1), got " + num(beta1_));
  if (!(beta2_ >= 0 && beta2_ < 1)) fail("beta2 must be in [0, 1), got " + num(beta2_));
  if (!(eps_ >= 0)) fail("eps must be >= 0, got " + num(eps_));
  if (amsgrad_ != 0 && amsgrad_ != 1) fail("amsgrad must be 0 or 1");
}

std::vector<std::string> Adam::state_buffers() const {
  if (amsgrad_ != 0) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  return {"exp_avg", "exp_avg_sq"};
}

void Adam::update(const ParamGroup& group, const Tensor& p, const Tensor& grad, ParamState& st) {
  const double lr = *group.lr, wd = *group.weight_decay;
  auto buffer = [&](const char* name) {
    Tensor b = st.get(name);
    if (!b.defined()) {
      b = zeros_like(p);
      st.set(name, b);
    }
    return b;
  };
  const AdamStep s = settings(stepping_.first, stepping_.second);
  const double bc1 = s.bc1, bc2_sqrt = s.bc2_sqrt;
  if (fusable(p, grad, st)) {
    // Queued: finish_step runs every fusable parameter of a device and dtype
    // in one call of the table's adam_step (one launch per 16 on CUDA).
    Tensor m = buffer("exp_avg"), v = buffer("exp_avg_sq");
    Tensor vmax = amsgrad_ != 0 ? buffer("max_exp_avg_sq") : Tensor();
    queued_.push_back({p.device(), p.dtype(), grad,
                       AdamTensor{
                           .s = s,
                           .n = p.numel(),
                           .param = p.raw_data(),
                           .grad = grad.raw_data(),
                           .exp_avg = m.raw_data(),
                           .exp_avg_sq = v.raw_data(),
                           .max_exp_avg_sq = vmax.defined() ? vmax.raw_data() : nullptr,
                       },
                       stepping_});
    return;
  }
  Tensor g = grad;
  if (wd != 0) {
    if (decoupled_) {
      mul_(p, 1.0 - lr * wd);
    } else {
      g = grad.clone();
      add_(g, p, wd);
    }
  }
  Tensor m = buffer("exp_avg"), v = buffer("exp_avg_sq");
  // m.lerp_(g, 1 - beta1), with lerp's two formulas as PyTorch evaluates them.
  const double w = 1.0 - beta1_;
  Tensor diff = g - m;
  if (w < 0.5) {
    add_(m, diff, w);
  } else {
    Tensor t = g.clone();
    add_(t, diff, -(1.0 - w));
    copy_(m, t);
  }
  mul_(v, beta2_);
  addcmul_(v, g, g, 1.0 - beta2_);

  Tensor second = v;
  if (amsgrad_ != 0) {
    Tensor vmax = buffer("max_exp_avg_sq");
    copy_(vmax, maximum(vmax, v));
    second = vmax;
  }
  Tensor denom = sqrt(second) / bc2_sqrt;
  add_(denom, constant_like(denom, eps_));
  addcdiv_(p, m, denom, -(lr / bc1));
}

AdamW::AdamW(const std::vector<Tensor>& params, const AdamWOptions& opts)
    : AdamW(std::vector<ParamGroup>{ParamGroup{params, {}, {}}}, opts) {}

AdamW::AdamW(std::vector<ParamGroup> groups, const AdamWOptions& opts)
    : Adam("AdamW", std::move(groups),
           AdamOptions{opts.lr, opts.betas, opts.eps, opts.weight_decay, opts.amsgrad}, true) {}

// ---- clipping ----
namespace {
void check_clip_options(double max_norm, double norm_type) {
  if (!(std::isinf(norm_type) && norm_type > 0) && !(norm_type > 0))
    throw std::invalid_argument("[clip_grad_norm_] norm_type must be > 0 or INFINITY, got " +
                                num(norm_type));
  if (!(max_norm >= 0))
    throw std::invalid_argument("[clip_grad_norm_] max_norm must be >= 0, got " + num(max_norm));
}
}  // namespace

namespace {
// The norms of `grads` (none empty, all of compute dtype `ct`, on one
// device) written into one f64 buffer by norm_n (one launch a chunk of
// tensors): the values of norm(g).to(f64) stacked, without a copy or a
// launch a gradient.
Tensor norms_into_one_buffer(const std::vector<Tensor>& grads, double norm_type, DType ct) {
  const Device device = grads[0].device();
  Tensor out = detail::make_tensor({static_cast<int64_t>(grads.size())}, DType::f64, device);
  std::vector<Tensor> rows;  // kept to the call: the contiguous copies of strided ones
  std::vector<TensorSpan> spans;
  for (const Tensor& g : grads) {
    rows.push_back(g.detach().contiguous());
    spans.push_back({rows.back().raw_data(), rows.back().numel()});
  }
  kernels(device).norm_n(ct, norm_type, {spans.data(), static_cast<int64_t>(spans.size())},
                         static_cast<double*>(out.raw_data()));
  return out;
}
}  // namespace

Tensor grad_norms(const std::vector<Tensor>& grads, double norm_type) {
  NoGradGuard no_grad;
  // One norm per gradient, left where it is (f64, gathered on the first
  // gradient's device): the total and the factor are computed there, so a
  // GPU run syncs once, for the value returned, not once per parameter.
  std::vector<Tensor> nonempty;
  for (const Tensor& g : grads)
    if (g.numel() > 0) nonempty.push_back(g);
  if (nonempty.empty()) return zeros({0}, {.dtype = DType::f64});
  // The common case, f32 or f64 gradients on one device: no copy a
  // gradient (a QLoRA step's clipping launched five kernels a parameter).
  const bool one_kind = std::all_of(nonempty.begin(), nonempty.end(), [&](const Tensor& g) {
    return g.device() == nonempty[0].device() && g.dtype() == nonempty[0].dtype() &&
           (g.dtype() == DType::f32 || g.dtype() == DType::f64);
  });
  // (A norm_type norm() refuses takes the per-gradient path, to its error.)
  if (one_kind && norm_type > 0)
    return norms_into_one_buffer(nonempty, norm_type, nonempty[0].dtype());
  std::vector<Tensor> norms;
  for (const Tensor& g : nonempty)
    norms.push_back(norm(g, norm_type).to(DType::f64).to(grads[0].device()));
  return stack(norms);
}

namespace {
// Scales `grads` by the clipping factor of the joint norm of the per-tensor
// `norms` (fn::clip_factor: max_norm / (total + 1e-6), at most 1, so
// gradients within the limit are multiplied by exactly 1; a NaN propagates
// into the gradients, as in PyTorch) and returns that norm (0-d f64, where
// the norms are). The gradients that share a dtype and device take one
// factor of their dtype, the total and it made by one clip_factor call
// (where a reduction and a scalar op each took a launch), and their
// contiguous ones are scaled together (scale_n: mul_'s bits in one launch a
// chunk, where a QLoRA step launched one a gradient).
Tensor scale_by_norms(const std::vector<Tensor>& grads, const Tensor& norms, double norm_type,
                      double max_norm) {
  const Tensor n = norms.to(DType::f64).contiguous();
  const KernelTable& k = kernels(n.device());
  const Tensor total = detail::make_tensor({}, DType::f64, n.device());
  const auto factor_in = [&](DType dtype) {
    Tensor f = detail::make_tensor({}, dtype, n.device());
    k.clip_factor(static_cast<const double*>(n.raw_data()), n.numel(), norm_type, max_norm, dtype,
                  static_cast<double*>(total.raw_data()), f.raw_data());
    return f;
  };
  struct Group {
    Tensor factor;  // in the group's dtype, on its device
    std::vector<TensorSpan> contiguous;
  };
  std::map<std::pair<DType, std::string>, Group> groups;
  for (const Tensor& g : grads) {
    if (!g.defined() || g.numel() == 0) continue;
    Group& group = groups[{g.dtype(), g.device().str()}];
    if (!group.factor.defined()) group.factor = factor_in(g.dtype()).to(g.device());
    if (g.is_contiguous() && is_floating(g.dtype()))
      group.contiguous.push_back({g.raw_data(), g.numel()});
    else
      mul_(g, group.factor);
  }
  if (groups.empty()) factor_in(DType::f64);  // no gradient to scale: the total alone
  for (const auto& [key, group] : groups)
    if (!group.contiguous.empty())
      kernels(group.factor.device())
          .scale_n(key.first,
                   {group.contiguous.data(), static_cast<int64_t>(group.contiguous.size())},
                   group.factor.raw_data());
  return total;
}
std::vector<Tensor> grads_of(const std::vector<Tensor>& params) {
  std::vector<Tensor> grads;
  for (const Tensor& p : params)
    if (p.defined() && p.grad().defined()) grads.push_back(p.grad());
  return grads;
}
}  // namespace

double clip_grads_by_norms(const std::vector<Tensor>& grads, const Tensor& norms, double max_norm,
                           double norm_type, bool error_if_nonfinite) {
  check_clip_options(max_norm, norm_type);
  if (norms.numel() == 0) return 0.0;
  NoGradGuard no_grad;
  // Checked before any gradient changes: the total alone first.
  if (error_if_nonfinite && !std::isfinite(scale_by_norms({}, norms, norm_type, max_norm).item()))
    throw std::runtime_error("[clip_grad_norm_] the total norm of order " + num(norm_type) +
                             " is non-finite, so it cannot be clipped");
  return scale_by_norms(grads, norms, norm_type, max_norm).item();
}

double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type,
                       bool error_if_nonfinite) {
  check_clip_options(max_norm, norm_type);
  const std::vector<Tensor> grads = grads_of(params);
  return clip_grads_by_norms(grads, grad_norms(grads, norm_type), max_norm, norm_type,
                             error_if_nonfinite);
}

Tensor clip_grad_norm_no_sync_(const std::vector<Tensor>& params, double max_norm,
                               double norm_type) {
  check_clip_options(max_norm, norm_type);
  const std::vector<Tensor> grads = grads_of(params);
  const Tensor norms = grad_norms(grads, norm_type);
  if (norms.numel() == 0) return zeros({}, {.dtype = DType::f64});
  NoGradGuard no_grad;
  return scale_by_norms(grads, norms, norm_type, max_norm);
}

void clip_grad_value_(const std::vector<Tensor>& params, double clip_value) {
  if (!(clip_value >= 0))
    throw std::invalid_argument("[clip_grad_value_] clip_value must be >= 0, got " +
                                num(clip_value));
  NoGradGuard no_grad;
  for (const Tensor& p : params) {
    if (!p.defined() || !p.grad().defined()) continue;
    const Tensor g = p.grad();
    copy_(g, clamp(g, -clip_value, clip_value));
  }
}

}  // namespace quanta
