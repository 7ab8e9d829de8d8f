#include "quant/nf4/nf4_import.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace quanta::quant {
namespace {

const std::string kTorchaoKey = ".torchao_nf4";

// The block size and double quantization `quanta quantize --format quanta`
// recorded for the file's nf4 tensors; block 0 when nothing was recorded.
struct Recorded {
  int64_t block = 0;
  bool double_quant = false;
};

Recorded recorded(const std::map<std::string, std::string>& metadata) {
  auto it = metadata.find("quanta.nf4");
  if (it == metadata.end()) return {};
  try {
    const auto j = nlohmann::json::parse(it->second);
    if (j.at("format").get<std::string>() != "quanta") return {};
    return {j.at("block_size").get<int64_t>(), j.at("double_quant").get<bool>()};
  } catch (const nlohmann::json::exception&) {
    return {};  // someone else's entry: nothing recorded
  }
}

// Units of a block-128 or -256 weight repeat its scale, so bitsandbytes'
// layout holds it at that block size; any unit alone is one block of 64.
BnbNF4State quanta_state(const Tensor& q, int64_t recorded_block) {
  if (recorded_block > kNF4UnitElems && recorded_block % kNF4UnitElems == 0) {
    try {
      return to_bnb(q, false, recorded_block);
    } catch (const std::invalid_argument&) {
      // Its units do not share a scale per block (an edited file).
    }
  }
  return to_bnb(q, false, kNF4UnitElems);
}

}  // namespace

const char* layout_name(NF4Layout layout) {
  switch (layout) {
    case NF4Layout::quanta:
      return "quanta";
    case NF4Layout::bitsandbytes:
      return "bitsandbytes";
    case NF4Layout::torchao:
      return "torchao";
  }
  return "?";
}

std::vector<NF4FileWeight> find_nf4_weights(const io::SafetensorsFile& file) {
  const std::map<std::string, Tensor> all(file.tensors.begin(), file.tensors.end());
  std::vector<NF4FileWeight> out;
  for (const auto& [name, t] : file.tensors) {
    if (t.dtype() == DType::nf4) {
      out.push_back({name, NF4Layout::quanta, {name}, {}});
    } else if (has_bnb_tensors(all, name)) {
      NF4FileWeight w{name, NF4Layout::bitsandbytes, {}, {}};
      for (const char* part : {"", ".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map",
                               ".quant_state.bitsandbytes__nf4"})
        if (all.count(name + part)) w.tensors.push_back(name + part);
      out.push_back(std::move(w));
    }
  }
  for (const auto& [key, value] : file.metadata) {
    if (!key.ends_with(kTorchaoKey)) continue;
    const std::string name = key.substr(0, key.size() - kTorchaoKey.size());
    NF4FileWeight w{name, NF4Layout::torchao, {}, {key}};
    for (const char* part :
         {".quantized_data", ".quantized_scalers", ".quantization_factor", ".scaler_mean", ".nf4"})
      if (all.count(name + part)) w.tensors.push_back(name + part);
    out.push_back(std::move(w));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return out;
}

NF4Weight read_nf4_weight(const io::SafetensorsFile& file, const NF4FileWeight& w) {
  const std::map<std::string, Tensor> all(file.tensors.begin(), file.tensors.end());
  NF4Weight out;
  switch (w.layout) {
    case NF4Layout::bitsandbytes:
      out.state = read_bnb_tensors(all, w.name);
      out.double_quant = out.state.double_quant;
      out.values = dequantize(out.state);
      break;
    case NF4Layout::torchao: {
      const TorchaoNF4State s = read_torchao_tensors(all, file.metadata, w.name);
      out.state = to_bnb(s);
      out.double_quant = true;
      out.values = torchao_dequantize(s);
      break;
    }
    case NF4Layout::quanta: {
      const Tensor& q = all.at(w.name);
      const Recorded r = recorded(file.metadata);
      out.double_quant = r.double_quant;
      out.state = quanta_state(q, r.block);
      out.values = dequantize(q);
      break;
    }
  }
  return out;
}

}  // namespace quanta::quant
