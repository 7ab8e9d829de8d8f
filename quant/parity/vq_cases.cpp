// Parity runner for the VectorQuantize family: VectorQuantize, ResidualVQ,
// GroupedResidualVQ and HierarchicalVQ cases (forward_backward and lookup). The layer is built
// from the case's constructor options; an option quanta cannot honour throws
// UnsupportedCase naming it.
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/nn/layers.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "quant/hierarchical/hierarchical_vq.h"
#include "quant/option_json.h"
#include "quant/parity/parity.h"
#include "quant/vq/residual_vq.h"
#include "quant/vq/vector_quantize.h"
#include "quant/vq/vq_option_fields.h"

namespace quanta::parity {
namespace {

using json = nlohmann::json;
using namespace quanta::quant;

[[noreturn]] void unsupported(const std::string& cls, const std::string& key, const json& v) {
  throw UnsupportedCase(cls + " option " + key + "=" + v.dump() + " is not supported by quanta");
}

// The reference's options quanta has no field for, accepted at these values
// only: multi-process or compiled-PyTorch switches and features left out.
const json& accepted_values() {
  static const json values = {
      {"manual_in_place_optimizer_update", false},
      {"in_place_codebook_optimizer", nullptr},
  };
  return values;
}

// A vq_bridge as a case spells it (the reference takes any module; a case
// names a torch.nn.Sequential by its layers): {"sequential": [["Linear", in,
// out], ["SiLU"], ...]}, state keys _codebook.vq_bridge.<i>.*. Its
// parameters come from the case's state.
std::shared_ptr<Module> bridge_module(const std::string& cls, const json& spec) {
  if (!spec.is_object() || !spec.contains("sequential") || !spec["sequential"].is_array())
    unsupported(cls, "vq_bridge", spec);
  Generator gen(0);
  auto seq = std::make_shared<Sequential>();
  for (const json& layer : spec["sequential"]) {
    const std::string kind = layer.is_array() && !layer.empty() && layer[0].is_string()
                                 ? layer[0].get<std::string>()
                                 : std::string();
    if (kind == "Linear" && layer.size() == 3)
      seq->push_back(
          std::make_shared<Linear>(layer[1].get<int64_t>(), layer[2].get<int64_t>(), gen));
    else if (kind == "SiLU" && layer.size() == 1)
      seq->push_back(std::make_shared<SiLU>());
    else if (kind == "ReLU" && layer.size() == 1)
      seq->push_back(std::make_shared<ReLU>());
    else if (kind == "Tanh" && layer.size() == 1)
      seq->push_back(std::make_shared<Tanh>());
    else
      unsupported(cls, "vq_bridge", spec);
  }
  return seq;
}

// The layer options inside a family's options, where the bridge goes (one
// module for every layer, as the reference passes it on).
VectorQuantizeOptions& layer_options(VectorQuantizeOptions& o) { return o; }
VectorQuantizeOptions& layer_options(ResidualVQOptions& o) { return o.layer; }
VectorQuantizeOptions& layer_options(GroupedResidualVQOptions& o) { return o.rvq.layer; }

// The reference's options that change nothing here, whatever their value:
// the syncs (one process; a distributed run reconciles codebooks and affine
// statistics through QuantizerSync, always).
bool ignored(const std::string& key) {
  return key == "sync_kmeans" || key == "sync_codebook" || key == "sync_affine_param";
}

// The options of class `cls` from a case: quanta's fields by the reference's
// names (quant/vq/vq_option_fields.h), the accepted values above, and
// "accept_3d_fmap" (one flag here for image and video maps).
template <class Options>
Options vq_options_of(const std::string& cls, const json& opts) {
  Options o;
  for (const auto& [k, v] : opts.items()) {
    if constexpr (std::is_same_v<Options, ResidualVQOptions>)
      if (k == "heads" && v != 1) unsupported(cls, k, v);  // the reference asserts it
    if (k == "accept_3d_fmap") {
      if (v == true) set_option(o, cls, "accept_image_fmap", true);
    } else if (ignored(k) || set_option(o, cls, k, v)) {
      continue;
    } else if (k == "vq_bridge") {
      if (!v.is_null()) layer_options(o).vq_bridge = bridge_module(cls, v);
    } else if (k == "mlp_kwargs" && v.is_object() &&
               !std::is_same_v<Options, VectorQuantizeOptions>) {
      for (const auto& [mk, mv] : v.items())
        if (!set_option(o, cls, "mlp_" + mk, mv)) unsupported(cls, k, v);
    } else if (accepted_values().contains(k)) {
      if (v != accepted_values()[k]) unsupported(cls, k, v);
    } else {
      unsupported(cls, k, v);
    }
  }
  return o;
}

VectorQuantizeOptions vq_options(const json& opts) {
  return vq_options_of<VectorQuantizeOptions>("VectorQuantize", opts);
}
ResidualVQOptions rvq_options(const json& opts) {
  return vq_options_of<ResidualVQOptions>("ResidualVQ", opts);
}
GroupedResidualVQOptions grvq_options(const json& opts) {
  return vq_options_of<GroupedResidualVQOptions>("GroupedResidualVQ", opts);
}

// HierarchicalVQ's options by the reference's names. Its scales (an int or a
// per-dim list per level) and codebook_size (an int or one per level) are
// lists, so they are read here; the levels' VectorQuantize options go through
// the option fields as VectorQuantize's do.
HierarchicalVQOptions hvq_options(const json& opts) {
  const std::string cls = "HierarchicalVQ";
  HierarchicalVQOptions o;
  auto ints = [&](const std::string& k, const json& v) {
    std::vector<int64_t> out;
    if (v.is_number_integer()) {
      out.push_back(v.get<int64_t>());
    } else if (v.is_array()) {
      for (const json& e : v) {
        if (!e.is_number_integer()) unsupported(cls, k, v);
        out.push_back(e.get<int64_t>());
      }
    } else {
      unsupported(cls, k, v);
    }
    return out;
  };
  for (const auto& [k, v] : opts.items()) {
    if (k == "dim")
      o.dim = v.get<int64_t>();
    else if (k == "codebook_size")
      o.codebook_size = ints(k, v);
    else if (k == "scales") {
      if (!v.is_array()) unsupported(cls, k, v);
      for (const json& level : v) o.scales.push_back(ints(k, level));
    } else if (k == "shared_codebook")
      o.shared_codebook = v.get<bool>();
    else if (k == "channel_first")
      o.channel_first = v.get<bool>();
    else if (k == "quant_resi")
      o.quant_resi = v.get<double>();
    else if (k == "share_quant_resi")
      o.share_quant_resi = v.get<int64_t>();
    else if (k == "nested_dropout")
      o.nested_dropout = v.get<double>();
    else if (k == "nested_dropout_min_levels")
      o.nested_dropout_min_levels = v.get<int64_t>();
    else if (k == "accept_image_fmap")
      o.accept_image_fmap = v.get<bool>();
    else if (k == "accept_3d_fmap")
      o.accept_3d_fmap = v.get<bool>();
    else if (!ignored(k) && !set_option(o.layer, cls, k, v))
      unsupported(cls, k, v);
  }
  return o;
}

// The module under test, whichever class it is, behind one interface.
struct Layer {
  std::shared_ptr<Module> module;
  std::function<QuantizeOutput(const Tensor&, const Tensor& mask)> forward;
  std::function<Tensor(const Tensor&)> codes, output;
  /** Where DiVeQ's noise is drawn (null: the class draws none). */
  VectorQuantize* diveq_draws = nullptr;
  /** Where nested dropout's cutoff is drawn (HierarchicalVQ only). */
  HierarchicalVQ* cutoff_draws = nullptr;
  /** The forward with topk codes (VectorQuantize only). */
  std::function<QuantizeOutput(const Tensor&, int64_t k, const Tensor& mask)> forward_topk;
};

Layer build(const std::string& cls, const json& opts) {
  Generator gen(0);  // the state comes from the case file
  Layer l;
  if (cls == "VectorQuantize") {
    auto m = std::make_shared<VectorQuantize>(vq_options(opts), gen);
    l.module = m;
    l.diveq_draws = m.get();
    l.forward_topk = [m](const Tensor& x, int64_t k, const Tensor& mask) {
      return m->forward_topk(x, k, mask);
    };
    l.forward = [m](const Tensor& x, const Tensor& mask) { return m->forward(x, mask); };
    l.codes = [m](const Tensor& i) { return m->get_codes_from_indices(i); };
    l.output = [m](const Tensor& i) { return m->get_output_from_indices(i); };
  } else if (cls == "ResidualVQ") {
    auto m = std::make_shared<ResidualVQ>(rvq_options(opts), gen);
    l.module = m;
    l.diveq_draws = &m->layer(0);
    l.forward = [m](const Tensor& x, const Tensor& mask) { return m->forward(x, mask); };
    l.codes = [m](const Tensor& i) { return m->get_codes_from_indices(i); };
    l.output = [m](const Tensor& i) { return m->get_output_from_indices(i); };
  } else if (cls == "GroupedResidualVQ") {
    auto m = std::make_shared<GroupedResidualVQ>(grvq_options(opts), gen);
    l.module = m;
    l.forward = [m](const Tensor& x, const Tensor& mask) { return m->forward(x, mask); };
    l.codes = [m](const Tensor& i) { return m->get_codes_from_indices(i); };
    l.output = [m](const Tensor& i) { return m->get_output_from_indices(i); };
  } else if (cls == "HierarchicalVQ") {
    auto m = std::make_shared<HierarchicalVQ>(hvq_options(opts), gen);
    l.module = m;
    l.cutoff_draws = m.get();
    l.forward = [m](const Tensor& x, const Tensor& mask) { return m->forward(x, mask); };
    l.output = [m](const Tensor& i) { return m->get_output_from_indices(i); };
  } else {
    throw UnsupportedCase("class '" + cls + "' is not in the VectorQuantize family");
  }
  return l;
}

bool is_state_key(const std::string& k) {
  static const char* io[] = {"x",      "w",     "L",      "quantized", "indices",   "aux_loss",
                             "x_grad", "codes", "output", "codebooks", "token_mask"};
  for (const char* n : io)
    if (k == n) return false;
  return k.rfind("aux_loss.", 0) != 0 && k.rfind("draws.", 0) != 0 && !k.ends_with("_after") &&
         !k.ends_with("_grad");
}

// Copies every state tensor of the case into the module (and its aliases).
void load_state(const CaseFile& c, Module& m, const json& aliases) {
  NoGradGuard no_grad;
  auto put = [&](const std::string& key, const Tensor& value) {
    const Tensor dst = m.find(key);
    if (!dst.defined())
      throw UnsupportedCase("the case holds state '" + key + "' that quanta's " + m.type_name() +
                            " does not have");
    if (dst.shape() != value.shape())
      throw std::runtime_error("state '" + key + "' has shape " + shape_str(value.shape()) +
                               ", quanta's layer has " + shape_str(dst.shape()));
    copy_(dst, to_dtype(value, dst.dtype()));
  };
  for (const auto& [k, t] : c.tensors)
    if (is_state_key(k)) put(k, t);
  for (const auto& [alias, target] : aliases.items())
    if (c.has(target.get<std::string>())) {
      const Tensor dst = m.find(alias);
      if (!dst.defined() || !dst.is_same(m.find(target.get<std::string>())))
        if (dst.defined()) put(alias, c.at(target.get<std::string>()));
    }
}

// The reference's draws inside the forward, replayed from the case: DiVeQ's
// direction noise ("draws.directional_noise", the reference's randn_like of
// the error, reshaped to the draw quanta asks for) and HierarchicalVQ's
// nested-dropout cutoff ("draws.cutoff", -1: every level kept).
void replay_draws(const CaseFile& c, Layer& l, CaseResult& r) {
  for (const auto& [k, t] : c.tensors) {
    if (k.rfind("draws.", 0) != 0) continue;
    const std::string name = k.substr(6);
    if (name == "cutoff" && l.cutoff_draws) {
      l.cutoff_draws->draw_cutoff = [v = t.item<int64_t>()] { return v; };
      r.replayed_draws.push_back(name);
      continue;
    }
    if (name != "directional_noise" || !l.diveq_draws)
      throw UnsupportedCase("the case replays draws '" + name + "' that quanta's " + r.cls +
                            " does not make");
    l.diveq_draws->directional_noise = [draws = t, name](const Shape& shape,
                                                         const TensorOptions& o) {
      if (draws.numel() != numel_of(shape))
        throw std::runtime_error("draws." + name + " holds " + std::to_string(draws.numel()) +
                                 " values; the forward draws " + shape_str(shape));
      return to_dtype(reshape(draws, shape), o.dtype);
    };
    r.replayed_draws.push_back(name);
  }
}

Tensor grad_or_zeros(const Tensor& t) {
  return t.grad().defined() ? t.grad() : zeros_like(t.detach());
}

}  // namespace

void run_vq_case(const CaseFile& c, double tolerance, CaseResult& r) {
  const json spec = json::parse(c.meta("spec"));
  const std::string kind = spec.value("kind", "forward_backward");
  Layer l = build(r.cls, spec.at("constructor_options"));
  const json aliases = spec.value("state_aliases", json::object());
  load_state(c, *l.module, aliases);
  const std::string mode = spec.value("mode", "train");
  l.module->train(mode == "train");

  if (kind == "lookup") {
    NoGradGuard no_grad;
    const Tensor& idx = c.at("indices");
    if (c.has("codes"))
      r.checks.push_back(compare("codes", l.codes(idx), c.at("codes"), tolerance));
    if (c.has("output"))
      r.checks.push_back(compare("output", l.output(idx), c.at("output"), tolerance));
    return;
  }
  if (kind != "forward_backward") throw UnsupportedCase("case kind '" + kind + "'");
  const json kwargs = spec.value("forward_kwargs", json::object());
  Tensor mask;
  int64_t topk = 0;
  for (const auto& [k, v] : kwargs.items()) {
    if (k == "mask" && v.is_object() && v.contains("tensor"))
      mask = to_dtype(c.at(v["tensor"].get<std::string>()), DType::boolean);
    else if (k == "topk" && v.is_number_integer() && l.forward_topk)
      topk = v.get<int64_t>();
    else if (k != "return_loss_breakdown" && !(k == "topk" && v.is_null()))
      unsupported("forward", k, v);
  }
  replay_draws(c, l, r);

  Tensor x = c.at("x").clone();
  x.requires_grad_(true);
  QuantizeOutput out = topk > 0 ? l.forward_topk(x, topk, mask) : l.forward(x, mask);
  const Tensor loss = add(sum(mul(out.quantized, c.at("w"))), sum(out.loss));
  if (loss.requires_grad()) loss.backward();

  r.checks.push_back(compare("quantized", out.quantized, c.at("quantized"), tolerance));
  r.checks.push_back(compare("indices", out.indices, c.at("indices"), tolerance));
  if (c.has("aux_loss"))
    r.checks.push_back(compare("aux_loss", out.loss, c.at("aux_loss"), tolerance));
  for (const auto& [k, t] : c.tensors) {
    if (k.rfind("aux_loss.", 0) == 0)
      r.checks.push_back(compare(k, out.term(k.substr(9)), t, tolerance));
  }
  r.checks.push_back(compare("L", loss, c.at("L"), tolerance));
  r.checks.push_back(compare("x_grad", grad_or_zeros(x), c.at("x_grad"), tolerance));
  for (const auto& [k, t] : c.tensors) {
    if (k.ends_with("_after")) {
      const std::string key = k.substr(0, k.size() - 6);
      const Tensor now = l.module->find(key);
      if (!now.defined()) throw UnsupportedCase("no state '" + key + "' to compare");
      r.checks.push_back(compare(k, now, t, tolerance));
    } else if (k.ends_with("_grad") && k != "x_grad") {
      const std::string key = k.substr(0, k.size() - 5);
      const Tensor p = l.module->find(key);
      if (!p.defined()) throw UnsupportedCase("no parameter '" + key + "' for its gradient");
      r.checks.push_back(compare(k, grad_or_zeros(p), t, tolerance));
    }
  }
}

}  // namespace quanta::parity
