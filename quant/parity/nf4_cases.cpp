// Parity runner for the NF4 format: bitsandbytes' quantize_4bit /
// dequantize_4bit cases (tests/data/reference-vectors/README.md, "NF4").
// Every value is exact: codes, packed bytes, scales and dequantized values
// are compared bit for bit whatever tolerance the caller passes.
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "engine/ops/view.h"
#include "quant/nf4/nf4_format.h"
#include "quant/nf4/nf4_interop.h"
#include "quant/parity/parity.h"

namespace quanta::parity {
namespace {

// The runner quantizes as the spec says bitsandbytes did: blocks of 64 and,
// with compress_statistics, groups of 256 scales. A spec that says anything
// else, or describes another weight than the file holds, is refused rather
// than compared against settings it does not state.
void check_nf4_spec(const CaseFile& c, const Tensor& weight, bool dq) {
  const nlohmann::json spec = nlohmann::json::parse(c.meta("spec"));
  auto bad = [&](const std::string& key, const std::string& why) {
    throw std::invalid_argument(c.path + ": spec." + key + " " + why);
  };
  auto whole = [&](const char* key) -> int64_t {
    if (!spec.contains(key)) bad(key, "is missing");
    if (!spec[key].is_number_integer()) bad(key, "must be a whole number, got " + spec[key].dump());
    return spec[key].get<int64_t>();
  };
  if (whole("blocksize") != 64)
    bad("blocksize", "is " + spec["blocksize"].dump() + "; the NF4 runner compares blocks of 64");
  if (whole("numel") != weight.numel())
    bad("numel", "is " + spec["numel"].dump() + ", the weight has " +
                     std::to_string(weight.numel()) + " elements");
  if (!spec.contains("shape") || !spec["shape"].is_array()) bad("shape", "must be a list of sizes");
  Shape shape;
  for (const auto& d : spec["shape"]) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0)
      bad("shape", "must hold sizes >= 0, got " + spec["shape"].dump());
    shape.push_back(d.get<int64_t>());
  }
  if (shape != weight.shape())
    bad("shape", "is " + spec["shape"].dump() + ", the weight's is " + shape_str(weight.shape()));
  const bool compress = spec.value("compress_statistics", false);
  if (compress != dq)
    bad("compress_statistics", std::string("is ") + (compress ? "true" : "false") +
                                   (dq ? ", but the file holds double-quant state"
                                       : ", but the file holds no double-quant state"));
  if (dq && whole("nested_blocksize") != 256)
    bad("nested_blocksize",
        "is " + spec["nested_blocksize"].dump() + "; the NF4 runner compares groups of 256");
}

}  // namespace

void run_nf4_case(const CaseFile& c, double, CaseResult& r) {
  const Tensor& weight = c.at("weight");
  const bool dq = c.has("nested_absmax");
  const int64_t n = weight.numel();
  check_nf4_spec(c, weight, dq);

  // 1. Quantize the float32 weight ourselves: codes and packed bytes always
  // match (codes use the exact block absmax); without double quant the scales
  // and the dequantized values match as well.
  quant::NF4Options opts;
  opts.block_size = 64;
  opts.double_quant = false;
  const Tensor q = quant::quantize_nf4(weight, opts);
  const quant::BnbNF4State mine = quant::to_bnb(q, false);
  r.checks.push_back(compare("codes", quant::nf4_codes(q), c.at("codes").reshape({n}), 0));
  r.checks.push_back(compare("packed", mine.packed, c.at("packed"), 0));
  r.checks.push_back(compare("quant_map", mine.quant_map, c.at("quant_map"), 0));
  // quantize_bnb goes straight to bitsandbytes' state (the path block-32
  // weights take): the same packed bytes.
  opts.double_quant = dq;
  const quant::BnbNF4State direct = quant::quantize_bnb(weight, opts);
  r.checks.push_back(compare("quantize_bnb packed", direct.packed, c.at("packed"), 0));
  if (!dq) {
    r.checks.push_back(compare("absmax", mine.absmax, c.at("absmax"), 0));
    r.checks.push_back(compare("dequantized", quant::dequantize(q), c.at("dequantized"), 0));
    r.checks.push_back(compare("quantize_bnb absmax", direct.absmax, c.at("absmax"), 0));
    r.checks.push_back(
        compare("quantize_bnb dequantized", quant::dequantize(direct), c.at("dequantized"), 0));
    return;
  }
  r.checks.push_back(
      compare("quantize_bnb absmax (8-bit codes)", direct.absmax, c.at("absmax"), 0));
  r.checks.push_back(compare("absmax_exact", mine.absmax, c.at("absmax_exact"), 0));

  // 2. Double quant: importing bitsandbytes' stored state must dequantize
  // bit-identically (scales reconstructed with two float32 roundings).
  quant::BnbNF4State s;
  s.packed = c.at("packed");
  s.absmax = c.at("absmax");
  s.quant_map = c.at("quant_map");
  s.nested_absmax = c.at("nested_absmax");
  s.nested_quant_map = c.at("nested_quant_map");
  s.nested_offset = static_cast<float>(c.at("nested_offset").item());
  s.double_quant = true;
  s.blocksize = 64;
  s.nested_blocksize = 256;
  s.shape = weight.shape();
  const Tensor imported = quant::from_bnb(s);
  r.checks.push_back(compare("absmax_dequantized", quant::nf4_unit_scales(imported),
                             c.at("absmax_dequantized"), 0));
  r.checks.push_back(compare("dequantized", quant::dequantize(imported), c.at("dequantized"), 0));

  // 3. Our own double quantization: the 8-bit code table is rebuilt from
  // bitsandbytes' recipe (PyTorch's float32 linspace rounds a few entries one
  // ulp differently, so 1e-6), the group scales and scale codes follow.
  const quant::BnbNF4State ours = quant::to_bnb(q, true);
  r.checks.push_back(
      compare("nested_quant_map", ours.nested_quant_map, c.at("nested_quant_map"), 1e-6));
  r.checks.push_back(compare("nested_absmax", ours.nested_absmax, c.at("nested_absmax"), 1e-6));
  r.checks.push_back(compare("absmax (8-bit codes)", ours.absmax, c.at("absmax"), 0));
  // Importing bitsandbytes' state and dequantizing it in that layout (no nf4
  // dtype in between) is bit-identical as well.
  r.checks.push_back(compare("dequantize(state)", quant::dequantize(s), c.at("dequantized"), 0));
}

}  // namespace quanta::parity
