#include "llm/qlora/layer_taps.h"

#include <map>
#include <stdexcept>
#include <utility>

#include "engine/nn/layers.h"
#include "quant/nf4/nf4_modules.h"

namespace quanta::llm {

namespace {

// A layer's forward with its input shown to `tap` first.
class InputTap : public Module {
 public:
  InputTap(std::shared_ptr<Module> layer, std::function<void(const Tensor&)> tap)
      : Module("InputTap"), layer_(std::move(layer)), tap_(std::move(tap)) {}
  Tensor forward(const Tensor& x) override {
    tap_(x);
    return layer_->forward(x);
  }

 private:
  std::shared_ptr<Module> layer_;
  std::function<void(const Tensor&)> tap_;
};

}  // namespace

LayerTaps::LayerTaps(CausalLM& model, const std::vector<std::string>& names,
                     const std::string& who) {
  std::map<std::string, Module*> modules;
  for (auto& [name, m] : model.named_modules()) modules[name] = m;
  for (const std::string& name : names) {
    const std::size_t dot = name.rfind('.');
    const auto parent = modules.find(dot == std::string::npos ? "" : name.substr(0, dot));
    Place p;
    if (parent != modules.end()) {
      p.parent = parent->second;
      p.child = dot == std::string::npos ? name : name.substr(dot + 1);
      for (auto& [n, c] : p.parent->named_children())
        if (n == p.child) p.layer = c;
    }
    if (auto* linear = dynamic_cast<Linear*>(p.layer.get()))
      p.in_features = linear->in_features();
    else if (auto* nf4 = dynamic_cast<quant::NF4Linear*>(p.layer.get()))
      p.in_features = nf4->in_features();
    else
      throw std::invalid_argument("[" + who + "] " + name + " is not a linear layer of the model");
    places_.push_back(std::move(p));
  }
}

LayerTaps::~LayerTaps() {
  for (std::size_t i = 0; i < places_.size(); ++i) remove(i);
}

void LayerTaps::set(std::size_t i, std::function<void(const Tensor&)> tap) {
  places_[i].parent->replace_module(places_[i].child,
                                    std::make_shared<InputTap>(places_[i].layer, std::move(tap)));
}

void LayerTaps::remove(std::size_t i) {
  places_[i].parent->replace_module(places_[i].child, places_[i].layer);
}

}  // namespace quanta::llm
