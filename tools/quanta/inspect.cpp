// `quanta inspect`: lists what a safetensors file holds without loading its
// tensors (so it also works on dtypes quanta cannot compute with).
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "engine/io/safetensors.h"

namespace quanta::cli {
namespace {

struct InspectOptions {
  std::string file;
  bool json = false;
};

uint64_t elements_of(const io::SafetensorsEntry& e) {
  uint64_t n = 1;
  for (int64_t s : e.shape) n *= static_cast<uint64_t>(s);  // validated: no overflow
  return n;
}

std::string shape_text(const Shape& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
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

// NF4 weights in the file: quanta's nf4 dtype (U8 bytes with metadata
// "quanta.dtype.NAME" = "nf4 [shape]") and bitsandbytes' layout (NAME with
// NAME.absmax and NAME.quant_state.bitsandbytes__nf4). Bits per parameter
// count the codes and scales, not per-tensor constants (code tables, JSON).
struct NF4Summary {
  uint64_t tensors = 0, params = 0, bytes = 0;
  double bits() const { return params ? 8.0 * double(bytes) / double(params) : 0.0; }
};

NF4Summary nf4_summary(const io::SafetensorsHeader& h) {
  NF4Summary s;
  auto entry = [&](const std::string& name) -> const io::SafetensorsEntry* {
    for (const auto& e : h.tensors)
      if (e.name == name) return &e;
    return nullptr;
  };
  for (const auto& e : h.tensors) {
    auto it = h.metadata.find("quanta.dtype." + e.name);
    if (it != h.metadata.end() && it->second.rfind("nf4 ", 0) == 0) {
      uint64_t n = 1;
      try {
        for (int64_t d : nlohmann::json::parse(it->second.substr(4)).get<Shape>())
          n *= static_cast<uint64_t>(d);
      } catch (const nlohmann::json::exception&) {
        continue;  // not quanta's entry after all: list the tensor as it is
      }
      s.tensors++, s.params += n, s.bytes += e.end - e.begin;
    } else if (entry(e.name + ".quant_state.bitsandbytes__nf4")) {
      s.tensors++;
      s.params += 2 * (e.end - e.begin);
      s.bytes += e.end - e.begin;
      for (const char* part : {".absmax", ".nested_absmax"})
        if (const auto* p = entry(e.name + part)) s.bytes += p->end - p->begin;
    }
  }
  return s;
}

void run_inspect(const InspectOptions& o) {
  io::SafetensorsHeader h = io::read_safetensors_header(o.file);
  std::sort(h.tensors.begin(), h.tensors.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  uint64_t total_elements = 0;
  for (const auto& e : h.tensors) total_elements += elements_of(e);

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
    if (const NF4Summary nf4 = nf4_summary(h); nf4.tensors)
      out["nf4"] = {{"tensors", nf4.tensors},
                    {"parameters", nf4.params},
                    {"bytes", nf4.bytes},
                    {"bits_per_parameter", nf4.bits()}};
    std::cout << out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    return;
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
              << std::string(shape_w - c.size() + 2, ' ')
              << std::string(bytes_w - d.size(), ' ') << d << "\n";
  };
  std::cout << o.file << "\n";
  if (!h.tensors.empty()) row("name", "dtype", "shape", "bytes");
  for (const auto& e : h.tensors)
    row(e.name, e.dtype, shape_text(e.shape), std::to_string(e.end - e.begin));
  std::cout << "total: " << h.tensors.size() << " tensors, " << total_elements
            << " elements, " << h.data_bytes << " bytes"
            << (h.data_bytes >= 1024 ? " (" + human_bytes(h.data_bytes) + ")" : "")
            << "; header " << h.header_bytes << " bytes\n";
  if (const NF4Summary nf4 = nf4_summary(h); nf4.tensors) {
    char line[160];
    std::snprintf(line, sizeof line,
                  "nf4: %llu tensors, %llu parameters, %llu bytes: %.3f bits per parameter\n",
                  static_cast<unsigned long long>(nf4.tensors),
                  static_cast<unsigned long long>(nf4.params),
                  static_cast<unsigned long long>(nf4.bytes), nf4.bits());
    std::cout << line;
  }
  std::cout << (h.metadata.empty() ? "metadata: none" : "metadata:") << "\n";
  for (const auto& [k, v] : h.metadata) std::cout << "  " << k << " = " << v << "\n";
}

}  // namespace

void add_inspect(CLI::App& app) {
  auto o = std::make_shared<InspectOptions>();
  CLI::App* sub = app.add_subcommand(
      "inspect",
      "List the tensors (name, dtype, shape, bytes), totals and metadata of a "
      "safetensors file; tensor data is not read");
  sub->add_option("file", o->file, "the .safetensors file")->required();
  sub->add_flag("--json", o->json, "print one JSON object instead of a table");
  sub->callback([o] { run_inspect(*o); });
}

}  // namespace quanta::cli
