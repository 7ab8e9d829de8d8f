// `quanta quantize IN OUT [--format quanta|bnb|torchao] [--block-size N]
// [--no-double-quant] [--include P]... [--exclude P]...`: NF4-quantizes the
// 2-d floating "...weight" tensors of a safetensors checkpoint (the linear
// weights), copies every other tensor as it is, and prints per tensor the
// RMSE and max |error| of the values the output file will dequantize to, and
// the bytes before and after. NF4 weights already in the input (bitsandbytes
// or torchao layout) are imported as they are and converted to the format.
// Block size 32 exists only in the bitsandbytes and torchao layouts: the nf4
// dtype of --format quanta holds one scale per 64 elements.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "engine/io/safetensors.h"
#include "quant/nf4/nf4_format.h"
#include "quant/nf4/nf4_interop.h"
#include "quant/nf4/nf4_modules.h"

namespace quanta::cli {
namespace {

struct QuantizeOptions {
  std::string in, out, format = "quanta";
  int64_t block_size = 64;
  bool no_double_quant = false;
  std::vector<std::string> include, exclude;
};

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(),
                                                suffix) == 0;
}

uint64_t bytes_of(const io::TensorMap& m) {
  uint64_t n = 0;
  for (const auto& [name, t] : m) n += t.nbytes();
  return n;
}

// Bytes of the codes and scales of a torchao state (per-tensor constants,
// the mean and the 16-entry table, not counted), as inspect counts them.
uint64_t torchao_payload_bytes(const quant::TorchaoNF4State& s) {
  return s.quantized_data.nbytes() + s.quantized_scalers.nbytes() +
         s.quantization_factor.nbytes();
}

void run_quantize(const QuantizeOptions& o) {
  if (o.format != "quanta" && o.format != "bnb" && o.format != "torchao")
    throw UsageError("--format must be quanta, bnb or torchao, got '" + o.format + "'");
  quant::NF4Options opts;
  opts.block_size = o.block_size;
  opts.double_quant = !o.no_double_quant;
  try {
    quant::check_options(opts);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  if (o.format == "quanta" && opts.block_size % quant::kNF4UnitElems != 0)
    throw UsageError("--format quanta stores the nf4 dtype, whose 64-element units hold block "
                     "sizes 64, 128 and 256; block size " + std::to_string(opts.block_size) +
                     " needs --format bnb or torchao");
  if (o.format == "torchao" && o.no_double_quant)
    throw UsageError("--format torchao always double-quantizes its scales; drop "
                     "--no-double-quant");
  // torchao double-quantizes the exact scales itself.
  quant::NF4Options exact = opts;
  exact.double_quant = false;

  const io::SafetensorsFile in = io::load_safetensors(o.in);
  io::TensorMap out;
  std::map<std::string, std::string> metadata = in.metadata;
  metadata["quanta.nf4"] = nlohmann::json{{"format", o.format},
                                          {"block_size", opts.block_size},
                                          {"double_quant", opts.double_quant}}
                               .dump();
  // NF4 weights already in the input (bitsandbytes or torchao layout) are
  // imported without requantizing and written in the requested format.
  const std::map<std::string, Tensor> all(in.tensors.begin(), in.tensors.end());
  std::map<std::string, quant::BnbNF4State> imported;
  std::set<std::string> consumed;
  for (const auto& [name, t] : in.tensors)
    if (quant::has_bnb_tensors(all, name)) {
      imported[name] = quant::read_bnb_tensors(all, name);
      for (const char* part : {"", ".absmax", ".quant_map", ".nested_absmax",
                               ".nested_quant_map", ".quant_state.bitsandbytes__nf4"})
        consumed.insert(name + part);
    }
  for (const auto& [key, value] : in.metadata)
    if (ends_with(key, ".torchao_nf4")) {
      const std::string name = key.substr(0, key.size() - std::string(".torchao_nf4").size());
      imported[name] = quant::to_bnb(quant::read_torchao_tensors(all, in.metadata, name));
      for (const char* part : {".quantized_data", ".quantized_scalers", ".quantization_factor",
                               ".scaler_mean", ".nf4"})
        consumed.insert(name + part);
      metadata.erase(key);
    }
  for (const auto& [name, s] : imported) {
    std::printf("%-40s imported NF4 %s (block %lld), written as %s\n", name.c_str(),
                shape_str(s.shape).c_str(), static_cast<long long>(s.blocksize),
                o.format.c_str());
    if (o.format == "quanta") {
      if (s.blocksize % quant::kNF4UnitElems != 0)
        throw std::invalid_argument("'" + name + "' has block size " +
                                    std::to_string(s.blocksize) +
                                    ", which the nf4 dtype of --format quanta cannot hold; "
                                    "use --format bnb or torchao");
      out.emplace_back(name, quant::from_bnb(s));
    } else if (o.format == "bnb") {
      quant::append_bnb_tensors(out, name, quant::to_bnb(s, opts.double_quant));
    } else {
      quant::append_torchao_tensors(out, metadata, name, quant::to_torchao(s));
    }
  }
  std::printf("%-40s %-14s %12s %12s %12s %12s\n", "tensor", "shape", "rmse", "max_abs",
              "bytes", "nf4_bytes");
  uint64_t params = 0, quantized_bytes = 0;
  int converted = 0;
  for (const auto& [name, t] : in.tensors) {
    if (consumed.count(name)) continue;
    const bool eligible = t.dim() == 2 && is_floating(t.dtype()) && ends_with(name, "weight") &&
                          quant::name_selected(name, o.include, o.exclude);
    if (!eligible) {
      out.emplace_back(name, t);
      continue;
    }
    Tensor values;       // what the output dequantizes to
    uint64_t after = 0;  // its codes and scales
    if (o.format == "quanta") {
      const Tensor q = quant::quantize_nf4(t, opts);
      out.emplace_back(name, q);
      values = quant::dequantize(q);
      after = q.nbytes();
    } else if (o.format == "bnb") {
      const quant::BnbNF4State s = quant::quantize_bnb(t, opts);
      quant::append_bnb_tensors(out, name, s);
      values = quant::dequantize(s);
      after = quant::bnb_payload_bytes(s);
    } else {
      const int64_t group = opts.block_size * 256;
      if (t.numel() % group != 0) {
        std::printf("%-40s skipped: torchao needs numel %% %lld == 0 at block %lld\n",
                    name.c_str(), static_cast<long long>(group),
                    static_cast<long long>(opts.block_size));
        out.emplace_back(name, t);
        continue;
      }
      const quant::TorchaoNF4State s = quant::to_torchao(quant::quantize_bnb(t, exact));
      quant::append_torchao_tensors(out, metadata, name, s);
      values = quant::torchao_dequantize(s);
      after = torchao_payload_bytes(s);
    }
    // Error of the values the output file holds.
    const Tensor w = t.to(DType::f32).contiguous();
    double sq = 0, mx = 0;
    for (int64_t i = 0; i < w.numel(); ++i) {
      const double e = std::abs(double(w.data<float>()[i]) - double(values.data<float>()[i]));
      sq += e * e;
      mx = std::max(mx, e);
    }
    const double rmse = w.numel() ? std::sqrt(sq / double(w.numel())) : 0.0;
    std::printf("%-40s %-14s %12.4e %12.4e %12zu %12llu\n", name.c_str(),
                shape_str(t.shape()).c_str(), rmse, mx, t.nbytes(),
                static_cast<unsigned long long>(after));
    params += static_cast<uint64_t>(t.numel());
    quantized_bytes += after;
    ++converted;
  }
  io::save_safetensors(o.out, out, metadata);
  const uint64_t b0 = bytes_of(in.tensors), b1 = bytes_of(out);
  const quant::NF4Bits bits = quant::bits_per_parameter(opts);
  std::printf("%d tensors quantized (%s, block %lld, double quant %s): %.3f bits per parameter "
              "in this file (codes and scales); quanta holds %.3f, bitsandbytes' layout %.3f\n",
              converted, o.format.c_str(), static_cast<long long>(opts.block_size),
              opts.double_quant ? "on" : "off",
              params ? 8.0 * double(quantized_bytes) / double(params) : 0.0, bits.stored,
              bits.bnb);
  std::printf("size: %llu -> %llu bytes (%.2fx smaller) written to %s\n",
              static_cast<unsigned long long>(b0), static_cast<unsigned long long>(b1),
              b1 ? double(b0) / double(b1) : 0.0, o.out.c_str());
}

}  // namespace

void add_quantize(CLI::App& app) {
  auto o = std::make_shared<QuantizeOptions>();
  CLI::App* sub = app.add_subcommand(
      "quantize",
      "NF4-quantize the 2-d '...weight' tensors of a safetensors checkpoint; print per-tensor "
      "RMSE / max abs error and the size before and after");
  sub->add_option("in", o->in, "input .safetensors")->required();
  sub->add_option("out", o->out, "output .safetensors")->required();
  sub->add_option("--format", o->format,
                  "quanta (nf4 dtype), bnb (bitsandbytes QuantState names) or torchao");
  sub->add_option("--block-size", o->block_size,
                  "elements per scale: 32 (bnb and torchao only), 64, 128 or 256");
  sub->add_flag("--no-double-quant", o->no_double_quant, "keep f32 block scales");
  sub->add_option("--include", o->include, "only tensors whose name contains one of these");
  sub->add_option("--exclude", o->exclude, "skip tensors whose name contains one of these");
  sub->callback([o] { run_quantize(*o); });
}

}  // namespace quanta::cli
