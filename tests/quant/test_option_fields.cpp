// Options as data: every family's options by the reference's names
// (quant/option_fields.h), read and shown as JSON (quant/option_json.h).
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>

#include "quant/option_json.h"
#include "quant/scalar/scalar_option_fields.h"
#include "quant/vq/vq_option_fields.h"

using namespace quanta::quant;
using json = nlohmann::json;

namespace {

// Every option of `o` as JSON, by name.
template <class Options>
json as_json(Options o) {
  json out = json::object();
  for_each_option(o, [&](std::string_view name, auto& field, OptionKind kind) {
    out[std::string(name)] = option_json(field, kind);
  });
  return out;
}

// No name twice: set_option would reach only the first.
template <class Options>
void check_names_unique(const char* who) {
  Options o;
  std::set<std::string> seen;
  for_each_option(o, [&](std::string_view name, auto&, OptionKind) {
    INFO(who << " " << name);
    CHECK(seen.insert(std::string(name)).second);
  });
}

// Shown, then read back into fresh options: the same options.
template <class Options>
void check_round_trip(const Options& o, const char* who) {
  const json shown = as_json(o);
  Options back;
  for (const auto& [k, v] : shown.items()) CHECK(set_option(back, who, k, v));
  CHECK(as_json(back) == shown);
}

}  // namespace

TEST_CASE("every family names each option once") {
  check_names_unique<VectorQuantizeOptions>("VectorQuantize");
  check_names_unique<ResidualVQOptions>("ResidualVQ");
  check_names_unique<GroupedResidualVQOptions>("GroupedResidualVQ");
  check_names_unique<SimVQOptions>("SimVQ");
  check_names_unique<FSQOptions>("FSQ");
  check_names_unique<ResidualFSQOptions>("ResidualFSQ");
  check_names_unique<LFQOptions>("LFQ");
  check_names_unique<ResidualLFQOptions>("ResidualLFQ");
}

TEST_CASE("options shown as JSON read back to the same options") {
  VectorQuantizeOptions vq;
  vq.decay = 0.5;
  vq.rotation_trick = false;
  check_round_trip(vq, "VectorQuantize");
  ResidualVQOptions rvq;
  rvq.codebook_sizes = {8, 16};
  rvq.layer.kmeans_init = true;
  check_round_trip(rvq, "ResidualVQ");
  GroupedResidualVQOptions grvq;
  grvq.groups = 4;
  grvq.rvq.num_quantizers = 3;
  check_round_trip(grvq, "GroupedResidualVQ");
  check_round_trip(SimVQOptions{}, "SimVQ");
  ResidualFSQOptions rfsq;
  rfsq.fsq.levels = {8, 5, 5, 5};
  rfsq.soft_clamp_input_value = 1.5;
  check_round_trip(rfsq, "ResidualFSQ");
  ResidualLFQOptions rlfq;
  rlfq.lfq.has_projections = true;
  check_round_trip(rlfq, "ResidualLFQ");
}

TEST_CASE("set_option: the reference's names, None, lists and sizes") {
  ResidualVQOptions o;
  CHECK(set_option(o, "ResidualVQ", "codebook_size", 32));
  CHECK(o.codebook_sizes == std::vector<int64_t>{32});
  CHECK(set_option(o, "ResidualVQ", "codebook_size", json::array({8, 16})));
  CHECK(o.codebook_sizes == std::vector<int64_t>{8, 16});
  // A layer option reaches the layers; the stack's own win over theirs.
  CHECK(set_option(o, "ResidualVQ", "decay", 0.5));
  CHECK(o.layer.decay == 0.5);
  CHECK(set_option(o, "ResidualVQ", "codebook_dim", 6));
  CHECK(o.codebook_dim == 6);
  CHECK(o.layer.codebook_dim == 0);
  // None keeps the default; optional fields take a value.
  CHECK(set_option(o, "ResidualVQ", "num_quantizers", nullptr));
  CHECK(o.num_quantizers == 0);
  CHECK(set_option(o, "ResidualVQ", "rotation_trick", false));
  CHECK(o.layer.rotation_trick == std::optional<bool>(false));
  CHECK_FALSE(set_option(o, "ResidualVQ", "no_such_option", 1));
  // ResidualFSQ's is_channel_first is its layers' channel_first.
  ResidualFSQOptions f;
  CHECK(set_option(f, "ResidualFSQ", "is_channel_first", true));
  CHECK(f.fsq.channel_first);
  CHECK(f.fsq.bound_hard_clamp);  // the stack's default, as the reference's
  // Sizes are whole numbers >= 1 and every value has its type; the error
  // names the class and the option.
  LFQOptions l;
  for (const json& bad : {json(0), json(-4), json(2.5), json("8")}) {
    CAPTURE(bad.dump());
    try {
      set_option(l, "LFQ", "codebook_size", bad);
      FAIL("accepted");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()).find("LFQ option 'codebook_size' must be a whole number >= 1") !=
            std::string::npos);
    }
  }
  CHECK_THROWS_WITH_AS(set_option(l, "LFQ", "spherical", 1),
                       "LFQ option 'spherical' must be true or false, got 1",
                       std::invalid_argument);
  CHECK_THROWS_AS(set_option(l, "LFQ", "codebook_scale", "big"), std::invalid_argument);
}
