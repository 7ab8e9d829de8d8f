// Parity runner for the VectorQuantize family: VectorQuantize, ResidualVQ and
// GroupedResidualVQ cases (forward_backward and lookup). The layer is built
// from the case's constructor options; an option quanta cannot honour throws
// UnsupportedCase naming it.
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "quant/parity/parity.h"
#include "quant/vq/residual_vq.h"
#include "quant/vq/vector_quantize.h"

namespace quanta::parity {
namespace {

using json = nlohmann::json;
using namespace quanta::quant;

[[noreturn]] void unsupported(const std::string& key, const json& v) {
  throw UnsupportedCase("option " + key + "=" + v.dump() + " is not supported by quanta");
}

// Options that only matter for multi-process or compiled PyTorch runs, or that
// are accepted when they hold their default value.
bool require_value(const std::string& key, const json& v, const json& allowed) {
  if (v != allowed) unsupported(key, v);
  return true;
}

std::optional<bool> opt_bool(const json& v) {
  if (v.is_null()) return std::nullopt;
  return v.get<bool>();
}

// One VectorQuantize option; false if `key` is not a VectorQuantize option.
bool set_vq_option(VectorQuantizeOptions& o, const std::string& key, const json& v) {
  if (key == "dim")
    o.dim = v.get<int64_t>();
  else if (key == "codebook_size")
    o.codebook_size = v.get<int64_t>();
  else if (key == "codebook_dim")
    o.codebook_dim = v.is_null() ? 0 : v.get<int64_t>();
  else if (key == "heads")
    o.heads = v.get<int64_t>();
  else if (key == "separate_codebook_per_head")
    o.separate_codebook_per_head = v.get<bool>();
  else if (key == "decay")
    o.decay = v.get<double>();
  else if (key == "eps")
    o.eps = v.get<double>();
  else if (key == "freeze_codebook")
    o.freeze_codebook = v.get<bool>();
  else if (key == "kmeans_init")
    o.kmeans_init = v.get<bool>();
  else if (key == "kmeans_iters")
    o.kmeans_iters = v.get<int64_t>();
  else if (key == "sync_kmeans" || key == "sync_codebook")
    return true;  // one process
  else if (key == "use_cosine_sim")
    o.use_cosine_sim = v.get<bool>();
  else if (key == "layernorm_after_project_in")
    o.layernorm_after_project_in = v.get<bool>();
  else if (key == "threshold_ema_dead_code")
    o.threshold_ema_dead_code = v.get<double>();
  else if (key == "channel_last")
    o.channel_last = v.get<bool>();
  else if (key == "accept_image_fmap" || key == "accept_3d_fmap")
    o.accept_image_fmap = o.accept_image_fmap || v.get<bool>();
  else if (key == "commitment_weight")
    o.commitment_weight = v.get<double>();
  else if (key == "commitment_use_cross_entropy_loss")
    o.commitment_use_cross_entropy_loss = v.get<bool>();
  else if (key == "orthogonal_reg_weight")
    o.orthogonal_reg_weight = v.get<double>();
  else if (key == "orthogonal_reg_active_codes_only")
    o.orthogonal_reg_active_codes_only = v.get<bool>();
  else if (key == "orthogonal_reg_max_codes")
    o.orthogonal_reg_max_codes = v.is_null() ? 0 : v.get<int64_t>();
  else if (key == "codebook_diversity_loss_weight")
    o.codebook_diversity_loss_weight = v.get<double>();
  else if (key == "codebook_diversity_temperature")
    o.codebook_diversity_temperature = v.get<double>();
  else if (key == "stochastic_sample_codes")
    o.stochastic_sample_codes = v.get<bool>();
  else if (key == "sample_codebook_temp")
    o.sample_codebook_temp = v.get<double>();
  else if (key == "straight_through")
    o.straight_through = v.get<bool>();
  else if (key == "rotation_trick")
    o.rotation_trick = opt_bool(v);
  else if (key == "learnable_codebook")
    o.learnable_codebook = opt_bool(v);
  else if (key == "ema_update")
    o.ema_update = opt_bool(v);
  else if (key == "affine_param")
    o.affine_param = v.get<bool>();
  else if (key == "affine_param_batch_decay")
    o.affine_param_batch_decay = v.get<double>();
  else if (key == "affine_param_codebook_decay")
    o.affine_param_codebook_decay = v.get<double>();
  else if (key == "sync_update_v")
    o.sync_update_v = v.get<double>();
  else if (key == "directional_reparam" || key == "sync_affine_param" ||
           key == "manual_ema_update" || key == "manual_in_place_optimizer_update")
    return require_value(key, v, false);
  else if (key == "vq_bridge" || key == "in_place_codebook_optimizer")
    return require_value(key, v, nullptr);
  else if (key == "return_zeros_for_masked_padding" || key == "route_gradients_to_input")
    return require_value(key, v, true);
  else if (key == "directional_reparam_variance")
    return true;  // only read by options that are off
  else
    return false;
  return true;
}

VectorQuantizeOptions vq_options(const json& opts) {
  VectorQuantizeOptions o;
  for (const auto& [k, v] : opts.items())
    if (!set_vq_option(o, k, v)) unsupported(k, v);
  return o;
}

ResidualVQOptions rvq_options(const json& opts) {
  ResidualVQOptions o;
  for (const auto& [k, v] : opts.items()) {
    if (k == "dim")
      o.dim = v.get<int64_t>();
    else if (k == "num_quantizers")
      o.num_quantizers = v.is_null() ? 0 : v.get<int64_t>();
    else if (k == "codebook_size") {
      if (v.is_array())
        o.codebook_sizes = v.get<std::vector<int64_t>>();
      else
        o.codebook_sizes = {v.get<int64_t>()};
    } else if (k == "codebook_dim")
      o.codebook_dim = v.is_null() ? 0 : v.get<int64_t>();
    else if (k == "shared_codebook")
      o.shared_codebook = v.get<bool>();
    else if (k == "quantize_dropout")
      o.quantize_dropout = v.get<bool>();
    else if (k == "quantize_dropout_cutoff_index")
      o.quantize_dropout_cutoff_index = v.get<int64_t>();
    else if (k == "quantize_dropout_multiple_of")
      o.quantize_dropout_multiple_of = v.get<int64_t>();
    else if (k == "accept_image_fmap")
      o.accept_image_fmap = v.get<bool>();
    else if (k == "heads")
      require_value(k, v, 1);
    else if (k == "diveq" || k == "implicit_neural_codebook")
      require_value(k, v, false);
    else if (k == "beam_size" || k == "eval_beam_size" || k == "beam_score_quantizer_weights")
      require_value(k, v, nullptr);
    else if (k == "quant_grad_frac")
      require_value(k, v, 0.0);
    else if (k == "mlp_kwargs")
      require_value(k, v, json::object());
    else if (!set_vq_option(o.layer, k, v))
      unsupported(k, v);
  }
  return o;
}

GroupedResidualVQOptions grvq_options(const json& opts) {
  GroupedResidualVQOptions o;
  json rest = json::object();
  for (const auto& [k, v] : opts.items()) {
    if (k == "dim")
      o.dim = v.get<int64_t>();
    else if (k == "groups")
      o.groups = v.get<int64_t>();
    else if (k == "accept_image_fmap")
      o.accept_image_fmap = v.get<bool>();
    else
      rest[k] = v;
  }
  rest["dim"] = o.dim / (o.groups > 0 ? o.groups : 1);
  o.rvq = rvq_options(rest);
  return o;
}

// The module under test, whichever class it is, behind one interface.
struct Layer {
  std::shared_ptr<Module> module;
  std::function<QuantizeOutput(const Tensor&)> forward;
  std::function<Tensor(const Tensor&)> codes, output;
};

Layer build(const std::string& cls, const json& opts) {
  Generator gen(0);  // the state comes from the case file
  Layer l;
  if (cls == "VectorQuantize") {
    auto m = std::make_shared<VectorQuantize>(vq_options(opts), gen);
    l.module = m;
    l.forward = [m](const Tensor& x) { return m->forward(x); };
    l.codes = [m](const Tensor& i) { return m->get_codes_from_indices(i); };
    l.output = [m](const Tensor& i) { return m->get_output_from_indices(i); };
  } else if (cls == "ResidualVQ") {
    auto m = std::make_shared<ResidualVQ>(rvq_options(opts), gen);
    l.module = m;
    l.forward = [m](const Tensor& x) { return m->forward(x); };
    l.codes = [m](const Tensor& i) { return m->get_codes_from_indices(i); };
    l.output = [m](const Tensor& i) { return m->get_output_from_indices(i); };
  } else if (cls == "GroupedResidualVQ") {
    auto m = std::make_shared<GroupedResidualVQ>(grvq_options(opts), gen);
    l.module = m;
    l.forward = [m](const Tensor& x) { return m->forward(x); };
    l.codes = [m](const Tensor& i) { return m->get_codes_from_indices(i); };
    l.output = [m](const Tensor& i) { return m->get_output_from_indices(i); };
  } else {
    throw UnsupportedCase("class '" + cls + "' is not in the VectorQuantize family");
  }
  return l;
}

bool is_state_key(const std::string& k) {
  static const char* io[] = {"x",        "w",      "L",     "quantized", "indices",
                             "aux_loss", "x_grad", "codes", "output",    "codebooks"};
  for (const char* n : io)
    if (k == n) return false;
  return k.rfind("aux_loss.", 0) != 0 && !k.ends_with("_after") && !k.ends_with("_grad");
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
  for (const auto& [k, v] : kwargs.items())
    if (k != "return_loss_breakdown") unsupported("forward " + k, v);

  Tensor x = c.at("x").clone();
  x.requires_grad_(true);
  QuantizeOutput out = l.forward(x);
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
