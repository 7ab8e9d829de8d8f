// Module registry, traversal, modes and state dicts.
#include "engine/nn/module.h"

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <unordered_set>

#include "engine/autograd/grad_mode.h"
#include "engine/ops/elementwise.h"
#include "engine/text.h"

namespace quanta {

const Tensor* find_tensor(const StateDict& sd, std::string_view name) {
  for (const auto& [k, v] : sd)
    if (k == name) return &v;
  return nullptr;
}

StateDict add_prefix(const StateDict& sd, std::string_view prefix) {
  StateDict out;
  out.reserve(sd.size());
  for (const auto& [k, v] : sd) out.emplace_back(std::string(prefix) + k, v);
  return out;
}

StateDict strip_prefix(const StateDict& sd, std::string_view prefix) {
  StateDict out;
  for (const auto& [k, v] : sd)
    if (std::string_view(k).substr(0, prefix.size()) == prefix)
      out.emplace_back(k.substr(prefix.size()), v);
  return out;
}

Module::Module(std::string type_name) : type_name_(std::move(type_name)) {}

Tensor Module::forward(const Tensor&) {
  throw std::invalid_argument("[" + type_name_ +
                              "] has no single-input forward; call its own forward method");
}

Tensor Module::operator()(const Tensor& x) {
  const ForwardScope scope(*this);
  return forward(x);
}

int Module::add_forward_hooks(ForwardHook before, ForwardHook after) {
  forward_hooks_.push_back({next_hook_id_, std::move(before), std::move(after)});
  return next_hook_id_++;
}

void Module::remove_forward_hooks(int id) {
  std::erase_if(forward_hooks_, [id](const Hooks& h) { return h.id == id; });
}

Module::ForwardScope::ForwardScope(Module& module) : module_(module) {
  for (const Hooks& h : module_.forward_hooks_)
    if (h.before) h.before(module_);
}

Module::ForwardScope::~ForwardScope() {
  // In reverse, as scopes unwind; an `after` hook must not throw (it also
  // runs while an exception from the forward is on its way out).
  for (auto it = module_.forward_hooks_.rbegin(); it != module_.forward_hooks_.rend(); ++it)
    if (it->after) it->after(module_);
}

void Module::check_new_name(const char* op, const std::string& name) const {
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument("[" + type_name_ + "::" + op + "] " + why);
  };
  if (name.empty()) fail("empty name");
  if (name.find('.') != std::string::npos) fail("name '" + name + "' contains '.'");
  for (const auto& e : params_)
    if (e.name == name) fail("'" + name + "' is already a parameter");
  for (const auto& e : buffers_)
    if (e.name == name) fail("'" + name + "' is already a buffer");
  for (const auto& c : children_)
    if (c.first == name) fail("'" + name + "' is already a submodule");
}

Tensor Module::register_parameter(const std::string& name, const Tensor& value,
                                  bool requires_grad) {
  check_new_name("register_parameter", name);
  if (!value.defined())
    throw std::invalid_argument("[" + type_name_ + "::register_parameter] '" + name +
                                "' is undefined; leave optional parameters unregistered");
  if (!is_floating(value.dtype()))
    throw std::invalid_argument("[" + type_name_ + "::register_parameter] '" + name +
                                "' has dtype " + dtype_name(value.dtype()) +
                                ", expected a floating dtype (use a buffer)");
  Tensor p = value.detach();
  p.requires_grad_(requires_grad);
  params_.push_back({name, p, true});
  return p;
}

Tensor Module::register_buffer(const std::string& name, const Tensor& value, bool persistent) {
  check_new_name("register_buffer", name);
  if (!value.defined())
    throw std::invalid_argument("[" + type_name_ + "::register_buffer] '" + name +
                                "' is undefined");
  Tensor b = value.detach();
  buffers_.push_back({name, b, persistent});
  return b;
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> module) {
  check_new_name("register_module", name);
  if (!module)
    throw std::invalid_argument("[" + type_name_ + "::register_module] '" + name + "' is null");
  if (module.get() == this)
    throw std::invalid_argument("[" + type_name_ + "::register_module] '" + name +
                                "' is the module itself");
  children_.emplace_back(name, std::move(module));
}

std::shared_ptr<Module> Module::replace_module(const std::string& name,
                                               std::shared_ptr<Module> module) {
  if (!module || module.get() == this)
    throw std::invalid_argument("[" + type_name_ + "::replace_module] '" + name +
                                "' must be replaced by another, non-null module");
  for (auto& c : children_)
    if (c.first == name) {
      std::swap(c.second, module);
      return module;
    }
  throw std::invalid_argument("[" + type_name_ + "::replace_module] no submodule '" + name + "'");
}

// Depth-first walk over (prefix, module) pairs; every module once.
template <class F>
void Module::visit(const std::string& prefix, F&& f) const {
  std::unordered_set<const Module*> seen;
  std::function<void(const Module&, const std::string&)> rec = [&](const Module& m,
                                                                   const std::string& pre) {
    if (!seen.insert(&m).second) return;
    f(m, pre);
    for (const auto& [name, child] : m.children_) rec(*child, pre + name + ".");
  };
  rec(*this, prefix);
}

namespace {
using Named = std::vector<std::pair<std::string, Tensor>>;

void add_unique(Named& out, std::unordered_set<const TensorImpl*>& seen, const std::string& name,
                const Tensor& t) {
  if (seen.insert(t.impl()).second) out.emplace_back(name, t);
}
}  // namespace

std::vector<std::pair<std::string, Tensor>> Module::named_parameters(bool recurse) const {
  Named out;
  std::unordered_set<const TensorImpl*> seen;
  if (!recurse) {
    for (const auto& e : params_) add_unique(out, seen, e.name, e.tensor);
    return out;
  }
  visit("", [&](const Module& m, const std::string& pre) {
    for (const auto& e : m.params_) add_unique(out, seen, pre + e.name, e.tensor);
  });
  return out;
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_parameters(recurse)) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, Tensor>> Module::named_buffers(bool recurse) const {
  Named out;
  std::unordered_set<const TensorImpl*> seen;
  if (!recurse) {
    for (const auto& e : buffers_) add_unique(out, seen, e.name, e.tensor);
    return out;
  }
  visit("", [&](const Module& m, const std::string& pre) {
    for (const auto& e : m.buffers_) add_unique(out, seen, pre + e.name, e.tensor);
  });
  return out;
}

std::vector<Tensor> Module::buffers(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_buffers(recurse)) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::named_children() const {
  return children_;
}

std::vector<std::pair<std::string, Module*>> Module::named_modules() {
  std::vector<std::pair<std::string, Module*>> out;
  visit("", [&](const Module& m, const std::string& pre) {
    // Drop the trailing '.' of the prefix: the module's own name.
    out.emplace_back(pre.empty() ? pre : pre.substr(0, pre.size() - 1), const_cast<Module*>(&m));
  });
  return out;
}

Tensor Module::find(std::string_view dotted_name) const {
  const Module* m = this;
  for (;;) {
    const size_t dot = dotted_name.find('.');
    if (dot == std::string_view::npos) break;
    const std::string_view head = dotted_name.substr(0, dot);
    const Module* next = nullptr;
    for (const auto& [name, child] : m->children_)
      if (name == head) next = child.get();
    if (!next) return Tensor();
    m = next;
    dotted_name.remove_prefix(dot + 1);
  }
  for (const auto& e : m->params_)
    if (e.name == dotted_name) return e.tensor;
  for (const auto& e : m->buffers_)
    if (e.name == dotted_name) return e.tensor;
  return Tensor();
}

std::vector<Generator*> Module::random_streams() {
  std::vector<Generator*> out;
  for (const auto& [name, m] : named_modules())
    for (Generator* g : m->own_random_streams())
      if (std::find(out.begin(), out.end(), g) == out.end()) out.push_back(g);
  return out;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->train(on);
}

void Module::zero_grad() {
  for (const Tensor& p : parameters()) p.zero_grad();
}

void Module::collect_state(const std::string& prefix, StateDict& out) const {
  for (const auto& e : params_) out.emplace_back(prefix + e.name, e.tensor.detach());
  for (const auto& e : buffers_)
    if (e.persistent) out.emplace_back(prefix + e.name, e.tensor.detach());
  for (const auto& [name, child] : children_) child->collect_state(prefix + name + ".", out);
}

StateDict Module::state_dict() const {
  StateDict out;
  collect_state("", out);
  return out;
}

namespace {
std::string describe(const Tensor& t) { return shape_str(t.shape()) + " " + dtype_name(t.dtype()); }
}  // namespace

LoadResult Module::load_state_dict(const StateDict& sd, bool strict) {
  const StateDict own = state_dict();
  LoadResult result;
  std::vector<std::string> mismatched, duplicates;
  std::unordered_set<std::string> seen;
  for (const auto& [k, v] : sd) {
    if (!seen.insert(k).second) duplicates.push_back(k);
    if (!find_tensor(own, k)) result.unexpected_keys.push_back(k);
  }
  for (const auto& [k, dst] : own) {
    const Tensor* src = find_tensor(sd, k);
    if (!src) {
      result.missing_keys.push_back(k);
    } else if (!src->defined()) {
      mismatched.push_back(k + " (expected " + describe(dst) + ", got an undefined tensor)");
    } else if (src->shape() != dst.shape() || src->dtype() != dst.dtype()) {
      mismatched.push_back(k + " (expected " + describe(dst) + ", got " + describe(*src) + ")");
    }
  }
  std::vector<std::string> problems;
  if (strict && !result.missing_keys.empty())
    problems.push_back("missing keys: " + join_names(result.missing_keys));
  if (strict && !result.unexpected_keys.empty())
    problems.push_back("unexpected keys: " + join_names(result.unexpected_keys));
  if (!mismatched.empty()) problems.push_back("mismatched keys: " + join_names(mismatched));
  if (!duplicates.empty()) problems.push_back("duplicate keys: " + join_names(duplicates));
  if (!problems.empty()) {
    std::string msg = "[" + type_name_ + "::load_state_dict] ";
    for (size_t i = 0; i < problems.size(); ++i) msg += (i ? "; " : "") + problems[i];
    throw std::invalid_argument(msg);
  }
  NoGradGuard no_grad;
  for (const auto& [k, dst] : own)
    if (const Tensor* src = find_tensor(sd, k)) copy_(dst, *src);
  reload_host_state();
  return result;
}

namespace {
// A tensor whose bytes are elsewhere for now: sharded across ranks
// (dist::ShardedUnits empties a unit between its forwards) or still in a file
// (CausalLM::defer_weights). Its shape, dtype and device stand.
bool bytes_away(const Tensor& t) {
  return t.defined() && t.nbytes() > 0 && (!t.storage() || t.storage()->nbytes() == 0);
}
}  // namespace

void Module::reload_host_state() {
  // Buffers away come back as they left: the state read while they were
  // here stands.
  const bool away = std::any_of(buffers_.begin(), buffers_.end(),
                                [](const Entry& b) { return bytes_away(b.tensor); });
  if (!away) read_host_state();
  for (auto& [name, child] : children_) child->reload_host_state();
}

namespace {
// Makes `t` hold `value`'s storage and layout in place, so every handle to `t`
// (optimisers, layers) sees the moved or cast tensor.
void assign_in_place(const Tensor& t, const Tensor& value) {
  TensorImpl* d = t.impl();
  TensorImpl* s = value.impl();
  if (d == s) return;
  d->storage = s->storage;
  d->dtype = s->dtype;
  d->shape = s->shape;
  d->strides = s->strides;
  d->offset = s->offset;
  // The accumulator node caches the leaf's dtype and device: drop it.
  if (d->autograd) d->autograd->grad_accumulator.reset();
}

template <class F>
void convert_all(const std::vector<Tensor>& ts, F&& convert) {
  NoGradGuard no_grad;
  // Convert everything first so a failure leaves the module unchanged.
  std::vector<std::pair<Tensor, Tensor>> done;  // (new value, new grad)
  for (const Tensor& t : ts) {
    const Tensor g = t.grad();
    done.emplace_back(convert(t.detach()), g.defined() ? convert(g) : Tensor());
  }
  for (size_t i = 0; i < ts.size(); ++i) {
    assign_in_place(ts[i], done[i].first);
    if (done[i].second.defined()) ts[i].set_grad(done[i].second);
  }
}

std::vector<Tensor> all_tensors(const Module& m) {
  std::vector<Tensor> ts = m.parameters();
  for (const Tensor& b : m.buffers()) ts.push_back(b);
  return ts;
}
}  // namespace

void Module::check_bytes_here(const char* op) const {
  std::vector<std::pair<std::string, Tensor>> named = named_parameters();
  for (auto& b : named_buffers()) named.push_back(std::move(b));
  for (const auto& [name, t] : named)
    if (bytes_away(t))
      throw std::invalid_argument("[" + type_name_ + "::" + op + "] '" + name +
                                  "' holds no bytes here (sharded across ranks, or still in its "
                                  "file): move or cast the module once they are back");
}

void Module::to(Device device) {
  check_bytes_here("to");
  convert_all(all_tensors(*this), [&](const Tensor& t) { return t.to(device); });
}

void Module::to(DType dtype) {
  if (!is_floating(dtype))
    throw std::invalid_argument("[" + type_name_ + "::to] dtype " + std::string(dtype_name(dtype)) +
                                " is not floating; modules cast only to floating dtypes");
  std::vector<Tensor> floating;
  for (const Tensor& t : all_tensors(*this))
    if (is_floating(t.dtype())) floating.push_back(t);
  check_bytes_here("to");
  convert_all(floating, [&](const Tensor& t) { return t.to(dtype); });
}

}  // namespace quanta
