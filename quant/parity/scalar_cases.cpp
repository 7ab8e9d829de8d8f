// Parity runner for the FSQ and LFQ families, FSP and LatentQuantize: rebuilds
// FSQ, ResidualFSQ, LFQ, ResidualLFQ, FSP or LatentQuantize from a case's spec and stored state,
// makes the recorded call (train-mode forward + backward of L = sum(quantized * w) + sum(aux_loss),
// or the index lookups) and compares every stored result.
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
#include "quant/option_json.h"
#include "quant/parity/parity.h"
#include "quant/scalar/fsp.h"
#include "quant/scalar/fsq.h"
#include "quant/scalar/latent_quantize.h"
#include "quant/scalar/lfq.h"
#include "quant/scalar/residual_fsq.h"
#include "quant/scalar/residual_lfq.h"
#include "quant/scalar/scalar_option_fields.h"

namespace quanta::parity {
namespace {

using json = nlohmann::json;
using namespace quanta::quant;

// The options of class `cls` from a case's constructor options: quanta's
// fields by the reference's names (quant/scalar/scalar_option_fields.h);
// keys missing from the case keep quanta's defaults, which are the
// reference's. A size given is a whole number >= 1: the reference fails on 0
// and negative sizes, while quanta's options read 0 as "derive it", so a case
// could otherwise pass with an option it ignored.
template <class Options>
Options scalar_options_of(const std::string& cls, const json& ctor) {
  Options o;
  for (const auto& [k, v] : ctor.items()) {
    // Switches of the reference's implementation with nothing to change here.
    if (k == "return_indices" || k == "force_quantization_f32") continue;
    if (!set_option(o, cls, k, v)) throw UnsupportedCase(cls + " option '" + k + "'");
  }
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

// Builds `Layer` from the case (its options by name, its state from the
// file) and makes the recorded call: the index lookups `lookups` checks, or a
// forward through `forward` and the backward of forward_backward.
template <class Layer, class Options, class Lookups, class Forward>
void run_layer(const std::string& cls, const json& ctor, const CaseFile& c, bool lookup,
               Checker& check, Lookups&& lookups, Forward&& forward) {
  Generator gen(0);  // the state comes from the case file
  Layer m(scalar_options_of<Options>(cls, ctor), gen);
  load_state(m, c);
  if (lookup) {
    m.eval();
    lookups(m, c.at("indices"));
    return;
  }
  forward_backward(
      m, c, [&](const Tensor& x) { return forward(m, x); }, check);
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
  const auto plain = [](auto& m, const Tensor& x) { return m.forward(x, Tensor()); };
  // A single layer's codes of the case's indices, after and before project_out.
  const auto layer_codes = [&](auto& m, const Tensor& idx) {
    check("codes", m.indices_to_codes(idx));
    if (c.has("codes_before_project_out"))
      check("codes_before_project_out", m.indices_to_codes(idx, false));
  };
  // A stack's per-layer codes, its output and (when recorded) its codebooks.
  const auto stack_lookups = [&](auto& m, const Tensor& idx) {
    check("codes", m.get_codes_from_indices(idx));
    check("output", m.get_output_from_indices(idx));
    if (c.has("codebooks")) check("codebooks", m.codebooks());
  };
  if (r.cls == "FSQ") {
    run_layer<FSQ, FSQOptions>(
        r.cls, ctor, c, lookup, check,
        [&](FSQ& m, const Tensor& idx) {
          layer_codes(m, idx);
          check("level_indices", m.indices_to_level_indices(idx));
          check("implicit_codebook", m.implicit_codebook());
        },
        plain);
  } else if (r.cls == "FSP") {
    if (lookup) throw UnsupportedCase("FSP lookup cases");
    run_layer<FSP, FSPOptions>(
        r.cls, ctor, c, lookup, check, [](FSP&, const Tensor&) {},
        [&](FSP& m, const Tensor& x) {
          // The reference's two rand_like draws of the training perturbation.
          for (const char* what : {"perturbation", "keep"})
            if (c.has(std::string("draws.") + what)) r.replayed_draws.push_back(what);
          if (!r.replayed_draws.empty())
            m.uniform_draws = [&c](const std::string& what, const Shape& shape,
                                   const TensorOptions&) {
              return reshape(c.at("draws." + what), shape);
            };
          const QuantizeOutput out = m.forward(x, Tensor());
          if (c.has("level_indices"))
            check("level_indices", m.indices_to_level_indices(out.indices));
          return out;
        });
  } else if (r.cls == "LatentQuantize") {
    if (lookup) throw UnsupportedCase("LatentQuantize lookup cases");
    run_layer<LatentQuantize, LatentQuantizeOptions>(
        r.cls, ctor, c, lookup, check, [](LatentQuantize&, const Tensor&) {}, plain);
  } else if (r.cls == "ResidualFSQ") {
    run_layer<ResidualFSQ, ResidualFSQOptions>(r.cls, ctor, c, lookup, check, stack_lookups, plain);
  } else if (r.cls == "LFQ") {
    const json fk = spec.value("forward_kwargs", json::object());
    const double inv_t = fk.value("inv_temperature", 100.0);
    run_layer<LFQ, LFQOptions>(
        r.cls, ctor, c, lookup, check,
        [&](LFQ& m, const Tensor& idx) {
          layer_codes(m, idx);
          if (c.has("codebook")) check("codebook", m.codebook());
        },
        [&](LFQ& m, const Tensor& x) { return m.forward(x, Tensor(), inv_t); });
  } else if (r.cls == "ResidualLFQ") {
    run_layer<ResidualLFQ, ResidualLFQOptions>(r.cls, ctor, c, lookup, check, stack_lookups, plain);
  } else {
    throw UnsupportedCase("class '" + r.cls + "'");
  }
}

}  // namespace quanta::parity
