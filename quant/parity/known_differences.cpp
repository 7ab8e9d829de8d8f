// Documented differences between quanta and the reference that a parity run
// names instead of failing on (docs/vq.md, "Checking parity with
// vector-quantize-pytorch"). Only the tensors a difference explains are
// excused, and only when they fail; every other tensor of the case must pass.
#include <nlohmann/json.hpp>
#include <string>

#include "quant/parity/parity.h"

namespace quanta::parity {
namespace {

using json = nlohmann::json;

// The option as the reference resolved it, else as passed, else `fallback`
// (the reference's default).
json option(const json& spec, const char* key, const json& fallback) {
  for (const char* where : {"resolved", "constructor_options"}) {
    const json part = spec.value(where, json::object());
    if (part.contains(key) && !part[key].is_null()) return part[key];
  }
  return fallback;
}

// With the EMA update on, vector-quantize-pytorch updates the codebook in
// place during the forward; autograd then reads the post-update codebook for
// every term computed from the distance matrix, while quanta differentiates
// the forward it computed. The input gradient and everything upstream of it
// (project_in, a learnable codebook) differ by one EMA step.
constexpr const char* kEmaDistanceGradient = "ema-distance-gradient";

bool ema_distance_gradient_case(const CaseFile& c, const json& spec) {
  const auto cls = c.metadata.find("class");
  if (cls == c.metadata.end() || (cls->second != "VectorQuantize" && cls->second != "ResidualVQ" &&
                                  cls->second != "GroupedResidualVQ"))
    return false;
  if (spec.value("mode", "train") != "train" || spec.value("kind", "") != "forward_backward")
    return false;
  if (option(spec, "ema_update", true) == false) return false;
  const json diversity = option(spec, "codebook_diversity_loss_weight", 0.0);
  const bool uses_distances = (diversity.is_number() && diversity.get<double>() > 0) ||
                              option(spec, "commitment_use_cross_entropy_loss", false) == true;
  return uses_distances;
}

// x_grad and the parameter gradients upstream of the distances; project_out
// lies downstream and must still match.
bool upstream_gradient(const std::string& name) {
  return name == "x_grad" ||
         (name.ends_with("_grad") && name.find("project_out") == std::string::npos);
}

// ResidualVQ's beam search in training: vector-quantize-pytorch 1.32 takes
// the best path's residuals with t[..., 0, :], which on its [b, n, 1, l, d]
// residual history selects layer 0 rather than path 0, so only layer 0's
// codebook takes the path's statistics; quanta updates every layer's.
constexpr const char* kBeamUpdatesLayerZero = "beam-search-updates-layer-0";

bool beam_training_case(const CaseFile& c, const json& spec) {
  const auto cls = c.metadata.find("class");
  if (cls == c.metadata.end() || cls->second != "ResidualVQ") return false;
  if (spec.value("mode", "train") != "train") return false;
  const json beam = option(spec, "beam_size", nullptr);
  return beam.is_number_integer() && beam.get<int64_t>() > 1;
}

// The codebook state after the step of a layer other than 0.
bool later_layer_state(const std::string& name) {
  return name.ends_with("_after") && name.rfind("layers.", 0) == 0 &&
         name.rfind("layers.0.", 0) != 0;
}

}  // namespace

void mark_known_differences(const CaseFile& c, CaseResult& r) {
  auto meta = c.metadata.find("spec");
  if (meta == c.metadata.end()) return;
  const json spec = json::parse(meta->second, nullptr, false);
  if (!spec.is_object()) return;
  const bool ema_gradient = ema_distance_gradient_case(c, spec);
  const bool beam = beam_training_case(c, spec);
  for (TensorCheck& check : r.checks) {
    if (check.pass) continue;
    if (ema_gradient && upstream_gradient(check.name))
      check.known_difference =
          std::string(kEmaDistanceGradient) +
          ": with the EMA update on, the reference's gradient through the distances reads the "
          "codebook after its in-place update; quanta's reads the one the forward used "
          "(docs/vq.md)";
    else if (beam && later_layer_state(check.name))
      check.known_difference =
          std::string(kBeamUpdatesLayerZero) +
          ": after a beam search the reference updates only layer 0's codebook (its best-path "
          "selection drops the later layers' residuals); quanta updates every layer's "
          "(docs/vq.md)";
  }
}

}  // namespace quanta::parity
