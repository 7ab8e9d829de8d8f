// `quanta inspect`: lists what a safetensors file holds without loading its
// tensors (so it also works on dtypes quanta cannot compute with); only
// bitsandbytes' small JSON states are read, for the shapes of their weights.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "engine/io/safetensors.h"
#include "llm/model/model_folder.h"

namespace quanta::cli {
namespace {

struct InspectOptions {
  std::string file;
  bool json = false;
};

uint64_t elements_of(const io::SafetensorsEntry& e) {
  return static_cast<uint64_t>(numel_of(e.shape));  // validated: no overflow
}

std::string shape_text(const Shape& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string human_bytes(uint64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.1f %s" : "%.0f %s", v, units[u]);
  return buf;
}

// NF4 weights in the file, per layout: quanta's nf4 dtype (U8 bytes with
// metadata "quanta.dtype.NAME" = "nf4 [shape]"), bitsandbytes' (NAME with
// NAME.absmax and NAME.quant_state.bitsandbytes__nf4) and torchao's (metadata
// NAME.torchao_nf4 with NAME.quantized_data, ...). Bits per parameter count
// the codes and scales as stored, not per-tensor constants (code tables,
// offsets, JSON), as quant::bits_per_parameter does.
struct NF4Layout {
  uint64_t tensors = 0, params = 0, bytes = 0;
  // quanta layout: what bitsandbytes' layout of the same tensors costs, with
  // and without double quantization.
  uint64_t bnb_dq_bytes = 0, bnb_plain_bytes = 0;
  static double bits(uint64_t bytes, uint64_t params) {
    return params ? 8.0 * double(bytes) / double(params) : 0.0;
  }
  double bits() const { return bits(bytes, params); }
};

struct NF4Summary {
  NF4Layout quanta, bnb, torchao;
  // Block size and double quantization of the quanta-layout tensors, from the
  // "quanta.nf4" entry `quanta quantize` writes (block 64 and unknown without).
  int64_t block = 64;
  int double_quant = -1;  // -1: unknown, 0: off, 1: on
  bool any() const { return quanta.tensors || bnb.tensors || torchao.tensors; }
};

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// Largest bitsandbytes JSON state read (they are ~200 bytes).
constexpr uint64_t kMaxBnbStateBytes = 1 << 16;

NF4Summary nf4_summary(const std::string& path, const io::SafetensorsHeader& h) {
  NF4Summary s;
  auto entry = [&](const std::string& name) -> const io::SafetensorsEntry* {
    for (const auto& e : h.tensors)
      if (e.name == name) return &e;
    return nullptr;
  };
  // Shapes come from metadata and JSON states: any product may overflow.
  auto elements = [](const nlohmann::json& shape) -> std::optional<uint64_t> {
    try {
      if (const auto n = checked_numel(shape.get<Shape>())) return static_cast<uint64_t>(*n);
    } catch (const nlohmann::json::exception&) {
    }
    return std::nullopt;  // not an entry of ours after all
  };
  auto parse = [](const std::string& text) {
    return nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  };
  if (auto it = h.metadata.find("quanta.nf4"); it != h.metadata.end()) {
    try {
      const auto j = nlohmann::json::parse(it->second);
      if (j.at("format").get<std::string>() == "quanta") {
        s.block = j.at("block_size").get<int64_t>();
        s.double_quant = j.at("double_quant").get<bool>() ? 1 : 0;
      }
    } catch (const nlohmann::json::exception&) {
    }
    if (s.block <= 0) s.block = 64, s.double_quant = -1;
  }
  const uint64_t bs = static_cast<uint64_t>(s.block);
  for (const auto& e : h.tensors) {
    auto it = h.metadata.find("quanta.dtype." + e.name);
    if (it != h.metadata.end() && it->second.rfind("nf4 ", 0) == 0) {
      const auto n = elements(parse(it->second.substr(4)));
      if (!n) continue;  // list the tensor as it is
      s.quanta.tensors++, s.quanta.params += *n, s.quanta.bytes += e.end - e.begin;
      const uint64_t codes = ceil_div(*n, 2), blocks = ceil_div(*n, bs);
      s.quanta.bnb_plain_bytes += codes + 4 * blocks;
      s.quanta.bnb_dq_bytes += codes + blocks + 4 * ceil_div(blocks, 256);
    } else if (const auto* state = entry(e.name + ".quant_state.bitsandbytes__nf4")) {
      // The packed codes hold (n + 1) / 2 bytes: n is in the JSON state.
      if (state->end - state->begin > kMaxBnbStateBytes) continue;
      const std::vector<uint8_t> text = io::read_safetensors_bytes(path, h, *state);
      const auto j = parse(std::string(text.begin(), text.end()));
      const auto n = j.is_object() && j.contains("shape") ? elements(j["shape"]) : std::nullopt;
      if (!n) continue;
      s.bnb.tensors++;
      s.bnb.params += *n;
      s.bnb.bytes += e.end - e.begin;
      for (const char* part : {".absmax", ".nested_absmax"})
        if (const auto* p = entry(e.name + part)) s.bnb.bytes += p->end - p->begin;
    }
  }
  const std::string suffix = ".torchao_nf4";
  for (const auto& [key, value] : h.metadata) {
    if (key.size() <= suffix.size() ||
        key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    const std::string name = key.substr(0, key.size() - suffix.size());
    const auto* data = entry(name + ".quantized_data");
    const auto j = parse(value);
    const auto n = j.is_object() && j.contains("shape") ? elements(j["shape"]) : std::nullopt;
    if (!data || !n) continue;
    s.torchao.tensors++, s.torchao.params += *n;
    for (const char* part : {".quantized_data", ".quantized_scalers", ".quantization_factor"})
      if (const auto* p = entry(name + part)) s.torchao.bytes += p->end - p->begin;
  }
  return s;
}

// "4.127 (double quant)" or "4.127 with double quant, 4.500 without".
std::string bnb_export_text(const NF4Summary& s) {
  const NF4Layout& q = s.quanta;
  char buf[128];
  if (s.double_quant >= 0)
    std::snprintf(buf, sizeof buf, "%.3f (%s)",
                  NF4Layout::bits(s.double_quant ? q.bnb_dq_bytes : q.bnb_plain_bytes, q.params),
                  s.double_quant ? "double quant" : "no double quant");
  else
    std::snprintf(buf, sizeof buf, "%.3f with double quant, %.3f without",
                  NF4Layout::bits(q.bnb_dq_bytes, q.params),
                  NF4Layout::bits(q.bnb_plain_bytes, q.params));
  return buf;
}

// What one file holds, for a folder's total.
struct FileTotals {
  uint64_t tensors = 0, elements = 0, bytes = 0;
};

// Inspects one file: prints its table, or (json) fills `*json_out`.
FileTotals inspect_file(const std::string& file, bool json, nlohmann::ordered_json* json_out) {
  const InspectOptions o{file, json};
  io::SafetensorsHeader h = io::read_safetensors_header(o.file);
  std::sort(h.tensors.begin(), h.tensors.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  uint64_t total_elements = 0;
  for (const auto& e : h.tensors) total_elements += elements_of(e);
  const FileTotals totals{h.tensors.size(), total_elements, h.data_bytes};

  if (o.json) {
    nlohmann::ordered_json out;
    out["file"] = o.file;
    out["tensors"] = nlohmann::ordered_json::array();
    for (const auto& e : h.tensors)
      out["tensors"].push_back({{"name", e.name},
                                {"dtype", e.dtype},
                                {"shape", e.shape},
                                {"elements", elements_of(e)},
                                {"bytes", e.end - e.begin},
                                {"data_offsets", {e.begin, e.end}}});
    out["total_tensors"] = h.tensors.size();
    out["total_elements"] = total_elements;
    out["total_bytes"] = h.data_bytes;
    out["header_bytes"] = h.header_bytes;
    out["metadata"] = h.metadata;
    if (const NF4Summary nf4 = nf4_summary(o.file, h); nf4.any()) {
      auto layout = [](const NF4Layout& l) {
        return nlohmann::ordered_json{{"tensors", l.tensors},
                                      {"parameters", l.params},
                                      {"bytes", l.bytes},
                                      {"bits_per_parameter", l.bits()}};
      };
      out["nf4"] = nlohmann::ordered_json::object();
      if (nf4.quanta.tensors) {
        auto q = layout(nf4.quanta);
        const NF4Layout& l = nf4.quanta;
        q["bnb_export"] = {{"block_size", nf4.block},
                           {"double_quant", NF4Layout::bits(l.bnb_dq_bytes, l.params)},
                           {"no_double_quant", NF4Layout::bits(l.bnb_plain_bytes, l.params)}};
        if (nf4.double_quant >= 0) q["double_quant"] = nf4.double_quant == 1;
        out["nf4"]["quanta"] = q;
      }
      if (nf4.bnb.tensors) out["nf4"]["bitsandbytes"] = layout(nf4.bnb);
      if (nf4.torchao.tensors) out["nf4"]["torchao"] = layout(nf4.torchao);
    }
    *json_out = std::move(out);
    return totals;
  }

  std::size_t name_w = 4, dtype_w = 5, shape_w = 5, bytes_w = 5;
  for (const auto& e : h.tensors) {
    name_w = std::max(name_w, e.name.size());
    dtype_w = std::max(dtype_w, e.dtype.size());
    shape_w = std::max(shape_w, shape_text(e.shape).size());
    bytes_w = std::max(bytes_w, std::to_string(e.end - e.begin).size());
  }
  auto row = [&](const std::string& a, const std::string& b, const std::string& c,
                 const std::string& d) {
    std::cout << a << std::string(name_w - a.size() + 2, ' ') << b
              << std::string(dtype_w - b.size() + 2, ' ') << c
              << std::string(shape_w - c.size() + 2, ' ') << std::string(bytes_w - d.size(), ' ')
              << d << "\n";
  };
  std::cout << o.file << "\n";
  if (!h.tensors.empty()) row("name", "dtype", "shape", "bytes");
  for (const auto& e : h.tensors)
    row(e.name, e.dtype, shape_text(e.shape), std::to_string(e.end - e.begin));
  std::cout << "total: " << h.tensors.size() << " tensors, " << total_elements << " elements, "
            << h.data_bytes << " bytes"
            << (h.data_bytes >= 1024 ? " (" + human_bytes(h.data_bytes) + ")" : "") << "; header "
            << h.header_bytes << " bytes\n";
  const NF4Summary nf4 = nf4_summary(o.file, h);
  auto nf4_line = [](const char* layout, const NF4Layout& l, const std::string& tail) {
    if (!l.tensors) return;
    char line[200];
    std::snprintf(line, sizeof line,
                  "nf4 (%s layout): %llu tensors, %llu parameters, %llu bytes: %.3f bits per "
                  "parameter",
                  layout, static_cast<unsigned long long>(l.tensors),
                  static_cast<unsigned long long>(l.params),
                  static_cast<unsigned long long>(l.bytes), l.bits());
    std::cout << line << tail << "\n";
  };
  nf4_line(
      "quanta", nf4.quanta,
      "; bitsandbytes' layout at block " + std::to_string(nf4.block) + ": " + bnb_export_text(nf4));
  nf4_line("bitsandbytes", nf4.bnb, "");
  nf4_line("torchao", nf4.torchao, "");
  std::cout << (h.metadata.empty() ? "metadata: none" : "metadata:") << "\n";
  for (const auto& [k, v] : h.metadata) std::cout << "  " << k << " = " << v << "\n";
  return totals;
}

void print_json(const nlohmann::ordered_json& j) {
  std::cout << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
}

void run_inspect(const InspectOptions& o) {
  if (!std::filesystem::is_directory(o.file)) {
    nlohmann::ordered_json j;
    inspect_file(o.file, o.json, &j);
    if (o.json) print_json(j);
    return;
  }
  // A model folder: its one weight file, or each shard its index lists.
  const std::vector<std::string> files = llm::model_weight_files(o.file);
  FileTotals all;
  nlohmann::ordered_json each = nlohmann::ordered_json::array();
  for (std::size_t i = 0; i < files.size(); ++i) {
    if (!o.json && i > 0) std::cout << "\n";
    nlohmann::ordered_json j;
    const FileTotals t = inspect_file(files[i], o.json, &j);
    if (o.json) each.push_back(std::move(j));
    all.tensors += t.tensors, all.elements += t.elements, all.bytes += t.bytes;
  }
  if (o.json) {
    nlohmann::ordered_json out;
    out["folder"] = o.file;
    out["files"] = std::move(each);
    out["total_tensors"] = all.tensors;
    out["total_elements"] = all.elements;
    out["total_bytes"] = all.bytes;
    print_json(out);
    return;
  }
  std::cout << "\n"
            << o.file << ": " << files.size() << " weight file" << (files.size() == 1 ? "" : "s")
            << ", " << all.tensors << " tensors, " << all.elements << " elements, " << all.bytes
            << " bytes" << (all.bytes >= 1024 ? " (" + human_bytes(all.bytes) + ")" : "") << "\n";
}

}  // namespace

void add_inspect(CLI::App& app) {
  auto o = std::make_shared<InspectOptions>();
  CLI::App* sub =
      app.add_subcommand("inspect",
                         "List the tensors (name, dtype, shape, bytes), totals and metadata of a "
                         "safetensors file or a model folder's weight files; tensor data is not "
                         "read");
  sub->footer(
      "Examples:\n"
      "  quanta inspect runs/vq/checkpoint.safetensors\n"
      "  quanta inspect runs/clf/nf4.safetensors --json   # NF4 bits per parameter included\n"
      "  quanta inspect runs/lm-merged                     # a model folder, shards included");
  sub->add_option("file", o->file,
                  "the .safetensors file, or a model folder (its model.safetensors, or each "
                  "shard its model.safetensors.index.json lists, and their total)")
      ->required();
  sub->add_flag("--json", o->json, "print one JSON object instead of a table");
  sub->callback([o] { run_inspect(*o); });
}

}  // namespace quanta::cli
