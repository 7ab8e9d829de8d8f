#pragma once
// Module: named parameters, buffers and submodules, train/eval, state dicts.
//
// Names are dotted paths in registration order: a module lists its own
// parameters (or buffers), then each child's under "child.", recursively, the
// way PyTorch does, so checkpoints map one to one onto PyTorch's keys.
//
// Parameter and buffer handles never change identity: load_state_dict copies
// values in place and to(device / dtype) swaps the storage inside the same
// tensor, so layers and optimisers may keep the handles they were given.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/random/generator.h"
#include "engine/tensor.h"

namespace quanta {

/** Named tensors in a fixed order: what state_dict() returns and
 * load_state_dict() takes. The same type as io::TensorMap, so a state dict
 * saves to safetensors as it is. Names are unique. */
using StateDict = std::vector<std::pair<std::string, Tensor>>;

/** The tensor named `name` in `sd`, or nullptr. */
const Tensor* find_tensor(const StateDict& sd, std::string_view name);
/** `sd` with `prefix` put before every name (to merge several state dicts
 * into one checkpoint, e.g. "model." and "optim."). */
StateDict add_prefix(const StateDict& sd, std::string_view prefix);
/** The entries of `sd` whose names start with `prefix`, with it removed. */
StateDict strip_prefix(const StateDict& sd, std::string_view prefix);

/** What load_state_dict(strict = false) tolerated. */
struct LoadResult {
  std::vector<std::string> missing_keys;
  std::vector<std::string> unexpected_keys;
};

class Module {
 public:
  /** `type_name` names the module kind in errors ("Linear", "Sequential"). */
  explicit Module(std::string type_name = "Module");
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  /** The kind of module, as given to the constructor. */
  const std::string& type_name() const { return type_name_; }

  /** The forward pass of a single-input module; modules with other inputs
   * define their own and leave this throwing. */
  virtual Tensor forward(const Tensor& x);
  /** forward(x) between the forward hooks (ForwardScope). */
  Tensor operator()(const Tensor& x);

  // ---- forward hooks ----
  /** A callback run around a module's forward, given the module. */
  using ForwardHook = std::function<void(Module&)>;
  /** Adds hooks run around this module's forward: `before` just before it,
   * `after` just after it (also when it throws). operator() runs them; a
   * module whose forward takes other inputs is called inside a
   * ForwardScope by its owner, so that they run too. recompute() runs a
   * forward again in the backward, hooks included. Either may be empty.
   * Returns an id for remove_forward_hooks. Sharded data parallel gathers a
   * layer's weights in `before` and frees them in `after`. */
  int add_forward_hooks(ForwardHook before, ForwardHook after);
  /** Removes the hooks add_forward_hooks returned `id` for (no-op if gone). */
  void remove_forward_hooks(int id);
  /** Runs a module's `before` hooks when made and its `after` hooks when
   * destroyed: what a caller puts around a forward with other inputs. */
  class ForwardScope {
   public:
    explicit ForwardScope(Module& module);
    ~ForwardScope();
    ForwardScope(const ForwardScope&) = delete;
    ForwardScope& operator=(const ForwardScope&) = delete;

   private:
    Module& module_;
  };

  // ---- registration ----
  /** Registers `value` (floating) as parameter `name`: a detached leaf sharing
   * its storage, requiring grad unless `requires_grad` is false (frozen).
   * Returns the parameter handle to keep. */
  Tensor register_parameter(const std::string& name, const Tensor& value,
                            bool requires_grad = true);
  /** Registers a buffer: state that is not trained (running statistics,
   * codebooks updated by EMA). Persistent buffers are in the state dict.
   * Returns the buffer handle (detached, sharing storage with `value`). */
  Tensor register_buffer(const std::string& name, const Tensor& value, bool persistent = true);
  /** Registers `module` as child `name`; returns it. */
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    add_child(name, module);
    return module;
  }

  /** Puts `module` in place of the child `name` (same name, same position) and
   * returns the child it replaced; containers that keep their own list of
   * children (Sequential) update it too. For converting layers in place. */
  virtual std::shared_ptr<Module> replace_module(const std::string& name,
                                                 std::shared_ptr<Module> module);

  // ---- traversal (dotted names, registration order, each tensor or module
  // listed once even when shared) ----
  /** Parameters of this module and (if `recurse`) of its descendants. */
  std::vector<std::pair<std::string, Tensor>> named_parameters(bool recurse = true) const;
  /** The tensors of named_parameters(). */
  std::vector<Tensor> parameters(bool recurse = true) const;
  /** Buffers (persistent or not) of this module and its descendants. */
  std::vector<std::pair<std::string, Tensor>> named_buffers(bool recurse = true) const;
  /** The tensors of named_buffers(). */
  std::vector<Tensor> buffers(bool recurse = true) const;
  /** Direct children. */
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const;
  /** This module (name "") and all descendants, depth first. */
  std::vector<std::pair<std::string, Module*>> named_modules();
  /** The parameter or buffer at a dotted path ("enc.0.weight"); undefined if
   * there is none. */
  Tensor find(std::string_view dotted_name) const;

  // ---- modes ----
  /** Sets training mode on this module and all descendants. */
  virtual void train(bool on = true);
  /** train(false). */
  void eval() { train(false); }
  /** True in training mode (the default). */
  bool is_training() const { return training_; }

  /** The generators this module's forward and its descendants' draw from in
   * training (dropout masks), each once: a training checkpoint saves their
   * states, and recompute() replays them. */
  std::vector<Generator*> random_streams();
  /** This module's own part of random_streams(): none by default. */
  virtual std::vector<Generator*> own_random_streams() { return {}; }

  /** Drops the gradients of all parameters (sets them undefined). */
  void zero_grad();

  // ---- state ----
  /** Parameters then persistent buffers of each module, depth first, under
   * dotted names. Values are detached views sharing the module's storage:
   * clone them for a snapshot. Shared tensors appear under every name. */
  StateDict state_dict() const;
  /** Copies the values of `sd` into the parameters and buffers in place
   * (under NoGradGuard, across devices if needed). Shapes and dtypes must
   * match. With `strict`, missing and unexpected keys are errors too. Checks
   * everything before copying anything; the error lists every problem.
   * Returns the keys that strict = false tolerated. */
  LoadResult load_state_dict(const StateDict& sd, bool strict = true);

  /** Moves every parameter and buffer (and gradient) to `device`, keeping
   * each tensor's identity. Refuses (std::invalid_argument, naming it) a
   * tensor whose bytes are elsewhere: sharded away by dist::ShardedUnits, or
   * still in its file (CausalLM::defer_weights). */
  void to(Device device);
  /** Casts every floating parameter and buffer (and gradient) to the floating
   * `dtype`, keeping each tensor's identity; integer buffers are left as
   * they are. Refuses tensors whose bytes are elsewhere, as to(Device). */
  void to(DType dtype);

  /** Modules that keep a host copy of a buffer's value (a flag the forward
   * consults, so that a step on a GPU need not read the device) re-read it,
   * on this module and every descendant. load_state_dict and DataParallel's
   * broadcasts call it; call it after writing such a buffer any other way.
   * A module whose buffers are away (emptied by dist::ShardedUnits between
   * its forwards) keeps what it read while they were here. */
  void reload_host_state();

 protected:
  /** This module's own part of reload_host_state(): nothing by default. */
  virtual void read_host_state() {}

 private:
  struct Entry {
    std::string name;
    Tensor tensor;
    bool persistent = true;
  };
  void check_new_name(const char* op, const std::string& name) const;
  // Throws naming the first tensor whose bytes are elsewhere (sharded away,
  // or still in a file): `op` cannot move or cast it.
  void check_bytes_here(const char* op) const;
  void add_child(const std::string& name, std::shared_ptr<Module> module);
  void collect_state(const std::string& prefix, StateDict& out) const;
  template <class F>
  void visit(const std::string& prefix, F&& f) const;

  std::string type_name_;
  bool training_ = true;
  std::vector<Entry> params_;
  std::vector<Entry> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  struct Hooks {
    int id;
    ForwardHook before, after;
  };
  std::vector<Hooks> forward_hooks_;
  int next_hook_id_ = 0;
};

/** Puts `module` in eval mode for the guard's lifetime, then back into the
 * mode it was in: an evaluation inside training, or inference on a model
 * that may be training (dropout off, whatever the caller's mode). */
class EvalModeGuard {
 public:
  explicit EvalModeGuard(Module& module) : module_(module), was_training_(module.is_training()) {
    module_.eval();
  }
  ~EvalModeGuard() { module_.train(was_training_); }
  EvalModeGuard(const EvalModeGuard&) = delete;
  EvalModeGuard& operator=(const EvalModeGuard&) = delete;

 private:
  Module& module_;
  bool was_training_;
};

}  // namespace quanta
