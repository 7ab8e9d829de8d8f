// Parity runner for the FSQ and LFQ families: rebuilds FSQ, ResidualFSQ, LFQ
// or ResidualLFQ from a case's spec and stored state, makes the recorded call
// (train-mode forward + backward of L = sum(quantized * w) + sum(aux_loss), or
// the index lookups) and compares every stored result.
#include <cmath>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "quant/parity/parity.h"
#include "quant/scalar/fsq.h"
#include "quant/scalar/lfq.h"
#include "quant/scalar/residual_fsq.h"
#include "quant/scalar/residual_lfq.h"

namespace quanta::parity {
namespace {

using json = nlohmann::json;
using namespace quanta::quant;

// The options a case passes; keys missing from the case keep quanta's
// defaults, which are the reference's.
template <class T>
void get(const json& j, const char* key, T& out) {
  auto it = j.find(key);
  if (it != j.end() && !it->is_null()) out = it->get<T>();
}

// A size the case gives: when present it is a whole number >= 1 (the
// reference fails on 0 and negative sizes, while quanta's options read 0 as
// "derive it", so a case could otherwise pass with an option it ignored).
void get_size(const json& j, const char* key, int64_t& out, const std::string& cls) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return;
  if (!it->is_number_integer() || it->get<int64_t>() < 1)
    throw std::invalid_argument(cls + " option '" + key + "' must be a whole number >= 1, got " +
                                it->dump());
  out = it->get<int64_t>();
}

void refuse_unknown(const json& ctor, const std::vector<std::string>& known,
                    const std::string& cls) {
  for (auto it = ctor.begin(); it != ctor.end(); ++it) {
    bool ok = false;
    for (const auto& k : known) ok = ok || k == it.key();
    if (!ok) throw UnsupportedCase(cls + " option '" + it.key() + "'");
  }
}

FSQOptions fsq_options(const json& ctor) {
  refuse_unknown(ctor,
                 {"levels", "dim", "num_codebooks", "keep_num_codebooks_dim", "channel_first",
                  "projection_has_bias", "preserve_symmetry", "noise_dropout", "bound_hard_clamp",
                  "orthogonal_rotation", "return_indices", "force_quantization_f32"},
                 "FSQ");
  FSQOptions o;
  get(ctor, "levels", o.levels);
  get_size(ctor, "dim", o.dim, "FSQ");
  get_size(ctor, "num_codebooks", o.num_codebooks, "FSQ");
  if (ctor.contains("keep_num_codebooks_dim") && !ctor["keep_num_codebooks_dim"].is_null())
    o.keep_num_codebooks_dim = ctor["keep_num_codebooks_dim"].get<bool>();
  get(ctor, "channel_first", o.channel_first);
  get(ctor, "projection_has_bias", o.projection_has_bias);
  get(ctor, "preserve_symmetry", o.preserve_symmetry);
  get(ctor, "noise_dropout", o.noise_dropout);
  get(ctor, "bound_hard_clamp", o.bound_hard_clamp);
  get(ctor, "orthogonal_rotation", o.orthogonal_rotation);
  return o;
}

ResidualFSQOptions rfsq_options(const json& ctor) {
  ResidualFSQOptions o;
  json layer = ctor;
  for (const char* k :
       {"num_quantizers", "quantize_dropout", "quantize_dropout_cutoff_index",
        "quantize_dropout_multiple_of", "soft_clamp_input_value", "is_channel_first"})
    layer.erase(k);
  if (!layer.contains("bound_hard_clamp")) layer["bound_hard_clamp"] = true;
  o.fsq = fsq_options(layer);
  get_size(ctor, "num_quantizers", o.num_quantizers, "the residual quantizer");
  get(ctor, "quantize_dropout", o.quantize_dropout);
  get(ctor, "quantize_dropout_cutoff_index", o.quantize_dropout_cutoff_index);
  get(ctor, "quantize_dropout_multiple_of", o.quantize_dropout_multiple_of);
  if (ctor.contains("soft_clamp_input_value") && !ctor["soft_clamp_input_value"].is_null())
    o.soft_clamp_input_value = ctor["soft_clamp_input_value"].get<double>();
  get(ctor, "is_channel_first", o.fsq.channel_first);
  return o;
}

LFQOptions lfq_options(const json& ctor) {
  refuse_unknown(ctor,
                 {"dim", "codebook_size", "entropy_loss_weight", "commitment_loss_weight",
                  "diversity_gamma", "num_codebooks", "keep_num_codebooks_dim", "codebook_scale",
                  "frac_per_sample_entropy", "has_projections", "projection_has_bias",
                  "soft_clamp_input_value", "channel_first", "spherical", "force_quantization_f32"},
                 "LFQ");
  LFQOptions o;
  get_size(ctor, "dim", o.dim, "LFQ");
  get_size(ctor, "codebook_size", o.codebook_size, "LFQ");
  get(ctor, "entropy_loss_weight", o.entropy_loss_weight);
  get(ctor, "commitment_loss_weight", o.commitment_loss_weight);
  get(ctor, "diversity_gamma", o.diversity_gamma);
  get_size(ctor, "num_codebooks", o.num_codebooks, "LFQ");
  if (ctor.contains("keep_num_codebooks_dim") && !ctor["keep_num_codebooks_dim"].is_null())
    o.keep_num_codebooks_dim = ctor["keep_num_codebooks_dim"].get<bool>();
  get(ctor, "codebook_scale", o.codebook_scale);
  get(ctor, "frac_per_sample_entropy", o.frac_per_sample_entropy);
  if (ctor.contains("has_projections") && !ctor["has_projections"].is_null())
    o.has_projections = ctor["has_projections"].get<bool>();
  get(ctor, "projection_has_bias", o.projection_has_bias);
  get(ctor, "soft_clamp_input_value", o.soft_clamp_input_value);
  get(ctor, "channel_first", o.channel_first);
  get(ctor, "spherical", o.spherical);
  return o;
}

ResidualLFQOptions rlfq_options(const json& ctor) {
  ResidualLFQOptions o;
  json layer = ctor;
  for (const char* k : {"num_quantizers", "quantize_dropout", "quantize_dropout_cutoff_index",
                        "quantize_dropout_multiple_of"})
    layer.erase(k);
  o.lfq = lfq_options(layer);
  get_size(ctor, "num_quantizers", o.num_quantizers, "the residual quantizer");
  get(ctor, "quantize_dropout", o.quantize_dropout);
  get(ctor, "quantize_dropout_cutoff_index", o.quantize_dropout_cutoff_index);
  get(ctor, "quantize_dropout_multiple_of", o.quantize_dropout_multiple_of);
  return o;
}

// Copies the case's stored state into every state entry of `m` it names.
void load_state(Module& m, const CaseFile& c) {
  StateDict sd;
  for (const auto& [name, t] : m.state_dict()) {
    if (!c.has(name)) throw std::runtime_error(c.path + ": no stored state '" + name + "'");
    sd.emplace_back(name, c.at(name));
  }
  m.load_state_dict(sd);
}

struct Checker {
  const CaseFile& c;
  double tol;
  CaseResult& r;
  void operator()(const std::string& name, const Tensor& actual, double tolerance = -1) {
    r.checks.push_back(compare(name, actual, c.at(name), tolerance < 0 ? tol : tolerance));
  }
};

// L = sum(quantized * w) + sum(aux_loss); backward; compare everything stored.
void forward_backward(Module& m, const CaseFile& c,
                      const std::function<QuantizeOutput(const Tensor&)>& run, Checker& check) {
  const std::string mode = c.meta("mode");
  m.train(mode == "train");
  const Tensor x = c.at("x").clone().requires_grad_();
  for (const Tensor& p : m.parameters()) p.zero_grad();
  const QuantizeOutput out = run(x);
  Tensor L = sum(out.quantized * c.at("w"));
  if (out.loss.defined()) L = L + sum(out.loss);
  L.backward();
  check("quantized", out.quantized);
  check("indices", out.indices);
  if (c.has("aux_loss")) check("aux_loss", out.loss);
  for (const auto& [name, t] : out.losses)
    if (c.has("aux_loss." + name)) check("aux_loss." + name, t);
  check("L", L);
  check("x_grad", x.grad().defined() ? x.grad() : zeros_like(x));
  for (const auto& [name, p] : m.named_parameters())
    if (c.has(name + "_grad")) check(name + "_grad", p.grad());
}

}  // namespace

void run_scalar_case(const CaseFile& c, double tolerance, CaseResult& r) {
  const json spec = json::parse(c.meta("spec"));
  const json ctor = spec.value("constructor_options", json::object());
  const std::string kind = c.meta("kind");
  Checker check{c, tolerance, r};
  if (kind != "forward_backward" && kind != "lookup")
    throw UnsupportedCase("case kind '" + kind + "'");
  const bool lookup = kind == "lookup";
  Generator gen(0);  // the state comes from the case file
  if (r.cls == "FSQ") {
    FSQ m(fsq_options(ctor), gen);
    load_state(m, c);
    if (lookup) {
      m.eval();
      const Tensor& idx = c.at("indices");
      check("codes", m.indices_to_codes(idx));
      if (c.has("codes_before_project_out"))
        check("codes_before_project_out", m.indices_to_codes(idx, false));
      check("level_indices", m.indices_to_level_indices(idx));
      check("implicit_codebook", m.implicit_codebook());
      return;
    }
    forward_backward(
        m, c, [&](const Tensor& x) { return m.forward(x, Tensor()); }, check);
  } else if (r.cls == "ResidualFSQ") {
    ResidualFSQ m(rfsq_options(ctor), gen);
    load_state(m, c);
    if (lookup) {
      m.eval();
      const Tensor& idx = c.at("indices");
      check("codes", m.get_codes_from_indices(idx));
      check("output", m.get_output_from_indices(idx));
      if (c.has("codebooks")) check("codebooks", m.codebooks());
      return;
    }
    forward_backward(
        m, c, [&](const Tensor& x) { return m.forward(x, Tensor()); }, check);
  } else if (r.cls == "LFQ") {
    LFQ m(lfq_options(ctor), gen);
    load_state(m, c);
    if (lookup) {
      m.eval();
      const Tensor& idx = c.at("indices");
      check("codes", m.indices_to_codes(idx));
      if (c.has("codes_before_project_out"))
        check("codes_before_project_out", m.indices_to_codes(idx, false));
      if (c.has("codebook")) check("codebook", m.codebook());
      return;
    }
    const json fk = spec.value("forward_kwargs", json::object());
    const double inv_t = fk.value("inv_temperature", 100.0);
    forward_backward(
        m, c, [&](const Tensor& x) { return m.forward(x, Tensor(), inv_t); }, check);
  } else if (r.cls == "ResidualLFQ") {
    ResidualLFQ m(rlfq_options(ctor), gen);
    load_state(m, c);
    if (lookup) {
      m.eval();
      const Tensor& idx = c.at("indices");
      check("codes", m.get_codes_from_indices(idx));
      check("output", m.get_output_from_indices(idx));
      if (c.has("codebooks")) check("codebooks", m.codebooks());
      return;
    }
    forward_backward(
        m, c, [&](const Tensor& x) { return m.forward(x, Tensor()); }, check);
  } else {
    throw UnsupportedCase("class '" + r.cls + "'");
  }
}

}  // namespace quanta::parity
