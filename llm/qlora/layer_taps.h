#pragma once
// A model's linear layers with their inputs shown to a callback: what the
// starts computed from data (EVA's, CorDA's) read. A tapped layer computes
// what it did; the layers go back in place when the taps go, also after a
// throw.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/nn/module.h"
#include "engine/tensor.h"
#include "llm/model/causal_lm.h"

namespace quanta::llm {

class LayerTaps {
 public:
  /** The layers `names` names (full module names), each a linear layer,
   * float or NF4. Throws std::invalid_argument "[who] <name> is not a
   * linear layer of the model" otherwise. Nothing is tapped yet. */
  LayerTaps(CausalLM& model, const std::vector<std::string>& names, const std::string& who);
  ~LayerTaps();
  LayerTaps(const LayerTaps&) = delete;
  LayerTaps& operator=(const LayerTaps&) = delete;

  /** Layer i's input features. */
  int64_t in_features(std::size_t i) const { return places_[i].in_features; }
  /** From now on layer i shows each input to `tap` before its forward. */
  void set(std::size_t i, std::function<void(const Tensor&)> tap);
  /** Layer i back in place, untapped. */
  void remove(std::size_t i);

 private:
  struct Place {
    Module* parent = nullptr;
    std::string child;
    std::shared_ptr<Module> layer;
    int64_t in_features = 0;
  };
  std::vector<Place> places_;
};

}  // namespace quanta::llm
