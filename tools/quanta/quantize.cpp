// `quanta quantize IN OUT [--format quanta|bnb|torchao] [--block-size N]
// [--double-quant | --no-double-quant] [--include P]... [--exclude P]...`:
// NF4-quantizes the 2-d floating "...weight" tensors of a safetensors
// checkpoint (the linear weights), copies every other tensor as it is, and
// prints per tensor the RMSE and max |error| of the values the output file
// will dequantize to, and the bytes before and after. NF4 weights already in
// the input (quanta, bitsandbytes or torchao layout) keep their codes, block
// size and double quantization and are converted to the format; one the
// format cannot hold is copied as it is and makes the run fail at the end.
// Block size 32 exists only in the bitsandbytes and torchao layouts: the nf4
// dtype of --format quanta holds one scale per 64 elements.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "commands.h"
#include "engine/io/safetensors.h"
#include "flag_checks.h"
#include "quant/nf4/nf4_format.h"
#include "quant/nf4/nf4_import.h"
#include "quant/nf4/nf4_interop.h"
#include "quant/nf4/nf4_modules.h"
#include "quantize_folder.h"

namespace quanta::cli {
namespace {

struct QuantizeOptions {
  std::string in, out, format = "quanta";
  int64_t block_size = 64;
  bool double_quant = false, no_double_quant = false;
  std::vector<std::string> include, exclude;
  std::string compute_dtype, max_shard_size;  // model folders only
  bool format_given = false;
};

// IN a model folder: transformers' 4-bit folder, whose layout and selection
// (every linear layer but lm_head) are fixed.
void quantize_model_folder(const QuantizeOptions& o) {
  if (o.format_given && o.format != "bnb")
    throw UsageError("--format " + o.format +
                     ": a model folder becomes transformers' 4-bit "
                     "folder, in bitsandbytes' layout (--format bnb)");
  if (!o.include.empty() || !o.exclude.empty())
    throw UsageError(
        "--include / --exclude: a model folder is quantized as load_in_4bit does "
        "(every linear layer but lm_head)");
  run_quantize_folder({.in = o.in,
                       .out = o.out,
                       .block_size = o.block_size,
                       .double_quant = !o.no_double_quant,
                       .compute_dtype = o.compute_dtype.empty() ? "auto" : o.compute_dtype,
                       .max_shard_size = o.max_shard_size});
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

uint64_t bytes_of(const io::TensorMap& m) {
  uint64_t n = 0;
  for (const auto& [name, t] : m) n += t.nbytes();
  return n;
}

// Bytes of the codes and scales of a torchao state (per-tensor constants,
// the mean and the 16-entry table, not counted), as inspect counts them.
uint64_t torchao_payload_bytes(const quant::TorchaoNF4State& s) {
  return s.quantized_data.nbytes() + s.quantized_scalers.nbytes() + s.quantization_factor.nbytes();
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(DType::f32).contiguous(), y = b.to(DType::f32).contiguous();
  double mx = 0;
  for (int64_t i = 0; i < x.numel(); ++i)
    mx = std::max(mx, std::abs(double(x.data<float>()[i]) - double(y.data<float>()[i])));
  return mx;
}

const char* on_off(bool b) { return b ? "on" : "off"; }

// Block size and double quantization of one NF4 tensor of the output, for
// the file's "quanta.nf4" entry.
struct Setting {
  int64_t block;
  bool double_quant;
  bool operator==(const Setting&) const = default;
};

// An NF4 weight of the input written in the requested format: its tensors
// (and metadata) in `out`, what it is written with, and whether its values
// changed. Throws std::invalid_argument when the format cannot hold it.
struct Converted {
  io::TensorMap tensors;
  std::map<std::string, std::string> metadata;
  Setting setting{64, false};
  Tensor values;  // undefined: the source's tensors copied as they are
};

// Copies the input's tensors and metadata entries that hold `w`.
void copy_weight(const io::SafetensorsFile& in, const quant::NF4FileWeight& w, io::TensorMap& out,
                 std::map<std::string, std::string>& metadata) {
  for (const auto& [name, t] : in.tensors)
    if (std::find(w.tensors.begin(), w.tensors.end(), name) != w.tensors.end())
      out.emplace_back(name, t);
  for (const auto& key : w.metadata) metadata[key] = in.metadata.at(key);
}

Converted convert_import(const io::SafetensorsFile& in, const quant::NF4FileWeight& w,
                         const quant::NF4Weight& src, const std::string& format,
                         std::optional<bool> dq_choice) {
  Converted c;
  const quant::BnbNF4State& s = src.state;
  // Imports keep their source's double quantization unless a flag says otherwise.
  const bool dq = dq_choice.value_or(src.double_quant);
  auto copy_source = [&] { copy_weight(in, w, c.tensors, c.metadata); };
  if (format == "bnb") {
    // Same setting: the state as it is (bitsandbytes' own bytes when it was one).
    const quant::BnbNF4State b = quant::to_bnb(s, dq);
    if (w.layout == quant::NF4Layout::bitsandbytes && b.double_quant == s.double_quant) {
      copy_source();
    } else {
      quant::append_bnb_tensors(c.tensors, w.name, b);
      c.values = quant::dequantize(b);
    }
    c.setting = {b.blocksize, b.double_quant};
  } else if (format == "quanta") {
    if (s.blocksize % quant::kNF4UnitElems != 0)
      throw std::invalid_argument(
          "block size " + std::to_string(s.blocksize) +
          " needs two scales per 64-element unit, which the nf4 dtype of --format quanta "
          "does not have (--format bnb or torchao keep it)");
    // Asked to double-quantize scales that are not: round them now.
    const bool requantize = dq && !src.double_quant;
    if (w.layout == quant::NF4Layout::quanta && !requantize) {
      copy_source();
    } else {
      const Tensor q = quant::from_bnb(requantize ? quant::to_bnb(s, true) : s);
      c.tensors.emplace_back(w.name, q);
      c.values = quant::dequantize(q);
    }
    c.setting = {s.blocksize, requantize || src.double_quant};
  } else {
    if (w.layout == quant::NF4Layout::torchao) {
      copy_source();
    } else {
      const quant::TorchaoNF4State t = quant::to_torchao(s);
      quant::append_torchao_tensors(c.tensors, c.metadata, w.name, t);
      c.values = quant::torchao_dequantize(t);
    }
    c.setting = {s.blocksize, true};
  }
  return c;
}

// What the flags ask for, checked.
struct QuantizePlan {
  quant::NF4Options opts;   // for weights quantized now
  quant::NF4Options exact;  // the same without double quantization (torchao does its own)
  // Set only by a flag: NF4 weights already in the input otherwise keep theirs.
  std::optional<bool> dq_choice;
};

// The output file as it is built, and what went into it.
struct QuantizeOutput {
  io::TensorMap tensors;
  std::map<std::string, std::string> metadata;
  std::vector<Setting> settings;   // of every NF4 tensor written
  std::set<std::string> consumed;  // input tensors of NF4 weights (imported or copied)
  std::vector<std::string> refused;
  int imported = 0, kept = 0, converted = 0;
  uint64_t params = 0, quantized_bytes = 0;  // of the tensors quantized now
  int optimizer_tensors = 0;                 // a training checkpoint's, not written
  uint64_t optimizer_bytes = 0;
};

// A training checkpoint of quanta train / finetune (train/checkpoint.h)
// holds Adam's state as "optim.*" tensors. It belongs to the float weights,
// so it cannot continue training an NF4 model, and it is 2x the weights:
// the NF4 file leaves it out (training resumes from the float checkpoint).
bool is_training_state(const io::SafetensorsFile& in, const std::string& name) {
  const auto framework = in.metadata.find("framework"), format = in.metadata.find("format");
  return framework != in.metadata.end() && framework->second == "quanta" &&
         format != in.metadata.end() && format->second.rfind("quanta-", 0) == 0 &&
         name.rfind("optim.", 0) == 0;
}

// Throws UsageError for flags that do not go together.
QuantizePlan plan_quantize(const QuantizeOptions& o) {
  if (o.format != "quanta" && o.format != "bnb" && o.format != "torchao")
    throw UsageError("--format must be quanta, bnb or torchao, got '" + o.format + "'");
  QuantizePlan plan;
  plan.opts.block_size = o.block_size;
  plan.opts.double_quant = !o.no_double_quant;
  if (o.double_quant) plan.dq_choice = true;
  if (o.no_double_quant) plan.dq_choice = false;
  try {
    quant::check_options(plan.opts);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  if (o.format == "quanta" && plan.opts.block_size % quant::kNF4UnitElems != 0)
    throw UsageError(
        "--format quanta stores the nf4 dtype, whose 64-element units hold block "
        "sizes 64, 128 and 256; block size " +
        std::to_string(plan.opts.block_size) + " needs --format bnb or torchao");
  if (o.format == "torchao" && o.no_double_quant)
    throw UsageError(
        "--format torchao always double-quantizes its scales; drop "
        "--no-double-quant");
  plan.exact = plan.opts;
  plan.exact.double_quant = false;
  return plan;
}

// Writes the input's NF4 weight `w` in the requested format and reports it;
// false (reported as refused, nothing written) when its data or the format
// does not allow it.
bool import_weight(const io::SafetensorsFile& in, const quant::NF4FileWeight& w,
                   const QuantizeOptions& o, const QuantizePlan& plan, QuantizeOutput& out) {
  const char* layout = quant::layout_name(w.layout);
  try {
    const quant::NF4Weight src = quant::read_nf4_weight(in, w);
    Converted c = convert_import(in, w, src, o.format, plan.dq_choice);
    const double change = c.values.defined() ? max_abs_diff(c.values, src.values) : 0.0;
    char values[64];
    if (change == 0)
      std::snprintf(values, sizeof values, "values unchanged");
    else
      std::snprintf(values, sizeof values, "values change by at most %.4e", change);
    std::printf(
        "%-40s imported NF4 %s (block %lld) from the %s layout, double quant %s; "
        "written as %s, double quant %s: %s\n",
        w.name.c_str(), shape_str(src.state.shape).c_str(),
        static_cast<long long>(src.state.blocksize), layout, on_off(src.double_quant),
        o.format.c_str(), on_off(c.setting.double_quant), values);
    out.settings.push_back(c.setting);
    ++out.imported;
    for (auto& t : c.tensors) out.tensors.push_back(std::move(t));
    for (auto& [k, v] : c.metadata) out.metadata[k] = v;
    return true;
  } catch (const std::exception& e) {
    // A problem with this weight's data or its format: the others go on.
    std::printf("%-40s refused: %s; copied in its %s layout\n", w.name.c_str(), e.what(), layout);
    out.refused.push_back(w.name);
    return false;
  }
}

// NF4 weights already in the input (any layout) are imported without
// re-quantizing their codes and written in the requested format. Those
// --include/--exclude leave out, and those the format cannot hold, are
// copied as they are.
void import_nf4_weights(const io::SafetensorsFile& in, const QuantizeOptions& o,
                        const QuantizePlan& plan, QuantizeOutput& out) {
  for (const quant::NF4FileWeight& w : quant::find_nf4_weights(in)) {
    out.consumed.insert(w.tensors.begin(), w.tensors.end());
    for (const auto& key : w.metadata) out.metadata.erase(key);
    if (!quant::name_selected(w.name, o.include, o.exclude)) {
      std::printf("%-40s NF4 (%s layout) not selected by --include/--exclude: copied as it is\n",
                  w.name.c_str(), quant::layout_name(w.layout));
      ++out.kept;
    } else if (import_weight(in, w, o, plan, out)) {
      continue;
    }
    copy_weight(in, w, out.tensors, out.metadata);
  }
}

// A weight as the output file holds it: the values it dequantizes to and the
// bytes of its codes and scales.
struct QuantizedWeight {
  Tensor values;
  uint64_t bytes = 0;
};

// Quantizes `t` into `out` in the requested format; nothing (`t` copied as
// it is) when torchao's layout cannot hold its size.
std::optional<QuantizedWeight> write_quantized(const std::string& name, const Tensor& t,
                                               const QuantizeOptions& o, const QuantizePlan& plan,
                                               QuantizeOutput& out) {
  if (o.format == "quanta") {
    const Tensor q = quant::quantize_nf4(t, plan.opts);
    out.tensors.emplace_back(name, q);
    return QuantizedWeight{quant::dequantize(q), q.nbytes()};
  }
  if (o.format == "bnb") {
    const quant::BnbNF4State s = quant::quantize_bnb(t, plan.opts);
    quant::append_bnb_tensors(out.tensors, name, s);
    return QuantizedWeight{quant::dequantize(s), quant::bnb_payload_bytes(s)};
  }
  const int64_t group = plan.opts.block_size * 256;
  if (t.numel() % group != 0) {
    std::printf("%-40s skipped: torchao needs numel %% %lld == 0 at block %lld\n", name.c_str(),
                static_cast<long long>(group), static_cast<long long>(plan.opts.block_size));
    out.tensors.emplace_back(name, t);
    return std::nullopt;
  }
  const quant::TorchaoNF4State s = quant::to_torchao(quant::quantize_bnb(t, plan.exact));
  quant::append_torchao_tensors(out.tensors, out.metadata, name, s);
  return QuantizedWeight{quant::torchao_dequantize(s), torchao_payload_bytes(s)};
}

// One row of the table: the error of the values the output file holds.
void print_error_row(const std::string& name, const Tensor& t, const QuantizedWeight& q) {
  const Tensor w = t.to(DType::f32).contiguous();
  double sq = 0, mx = 0;
  for (int64_t i = 0; i < w.numel(); ++i) {
    const double e = std::abs(double(w.data<float>()[i]) - double(q.values.data<float>()[i]));
    sq += e * e;
    mx = std::max(mx, e);
  }
  const double rmse = w.numel() ? std::sqrt(sq / double(w.numel())) : 0.0;
  std::printf("%-40s %-14s %12.4e %12.4e %12zu %12llu\n", name.c_str(),
              shape_str(t.shape()).c_str(), rmse, mx, t.nbytes(),
              static_cast<unsigned long long>(q.bytes));
}

// Quantizes the 2-d floating "...weight" tensors --include/--exclude select
// and copies every other tensor that is not part of an NF4 weight.
void quantize_float_weights(const io::SafetensorsFile& in, const QuantizeOptions& o,
                            const QuantizePlan& plan, QuantizeOutput& out) {
  bool table_started = false;  // its header goes above the first quantized tensor
  for (const auto& [name, t] : in.tensors) {
    if (out.consumed.count(name)) continue;
    if (is_training_state(in, name)) {
      ++out.optimizer_tensors;
      out.optimizer_bytes += t.nbytes();
      continue;
    }
    const bool eligible = t.dim() == 2 && is_floating(t.dtype()) && ends_with(name, "weight") &&
                          quant::name_selected(name, o.include, o.exclude);
    if (!eligible) {
      out.tensors.emplace_back(name, t);
      continue;
    }
    if (!table_started)
      std::printf("%-40s %-14s %12s %12s %12s %12s\n", "tensor", "shape", "rmse", "max_abs",
                  "bytes", "nf4_bytes");
    table_started = true;
    const std::optional<QuantizedWeight> q = write_quantized(name, t, o, plan, out);
    if (!q) continue;
    print_error_row(name, t, *q);
    out.params += static_cast<uint64_t>(t.numel());
    out.quantized_bytes += q->bytes;
    ++out.converted;
    out.settings.push_back({plan.opts.block_size, o.format == "torchao" || plan.opts.double_quant});
  }
}

// Saves the output with its "quanta.nf4" entry. The file records one
// setting: its NF4 tensors' when they share one (a file of imports converted
// as they were), else the options of this run.
void save_output(const QuantizeOptions& o, const QuantizePlan& plan, QuantizeOutput& out) {
  const std::vector<Setting>& settings = out.settings;
  Setting file_setting{plan.opts.block_size, plan.opts.double_quant};
  if (!settings.empty() && std::all_of(settings.begin(), settings.end(),
                                       [&](const Setting& s) { return s == settings[0]; }))
    file_setting = settings[0];
  out.metadata["quanta.nf4"] = nlohmann::json{
      {"format", o.format},
      {"block_size", file_setting.block},
      {"double_quant",
       file_setting.double_quant}}.dump();
  io::save_safetensors(o.out, out.tensors, out.metadata);
}

void print_summary(const io::SafetensorsFile& in, const QuantizeOptions& o,
                   const QuantizePlan& plan, const QuantizeOutput& out) {
  const uint64_t b0 = bytes_of(in.tensors), b1 = bytes_of(out.tensors);
  const quant::NF4Bits bits = quant::bits_per_parameter(plan.opts);
  if (out.converted > 0) {
    std::printf(
        "%d tensors quantized (%s, block %lld, double quant %s): %.3f bits per "
        "parameter in this file (codes and scales); quanta holds %.3f, bitsandbytes' "
        "layout %.3f\n",
        out.converted, o.format.c_str(), static_cast<long long>(plan.opts.block_size),
        on_off(plan.opts.double_quant), 8.0 * double(out.quantized_bytes) / double(out.params),
        bits.stored, bits.bnb);
  } else {
    // Nothing to do is not an error (exit 0), but it must not read like a result.
    const bool lists = !o.include.empty() || !o.exclude.empty();
    std::printf(
        "nothing to quantize: %s has no 2-d floating tensor whose name ends in "
        "'weight'%s\n",
        o.in.c_str(), lists ? " and that --include/--exclude select" : "");
  }
  if (out.imported + out.kept + static_cast<int>(out.refused.size()) > 0)
    std::printf(
        "NF4 tensors already in the input: %d written as %s, %d not selected, %zu "
        "refused (copied as they were)\n",
        out.imported, o.format.c_str(), out.kept, out.refused.size());
  if (out.optimizer_tensors > 0)
    std::printf(
        "optimizer state: %d tensors (%llu bytes) of the training checkpoint not written (it "
        "belongs to the float weights; resume training from %s)\n",
        out.optimizer_tensors, static_cast<unsigned long long>(out.optimizer_bytes), o.in.c_str());
  if (out.converted + out.imported > 0 && out.optimizer_tensors > 0)
    std::printf(
        "size: %llu -> %llu bytes (%.2fx smaller; the model's tensors %llu -> %llu, %.2fx) "
        "written to %s\n",
        static_cast<unsigned long long>(b0), static_cast<unsigned long long>(b1),
        b1 ? double(b0) / double(b1) : 0.0,
        static_cast<unsigned long long>(b0 - out.optimizer_bytes),
        static_cast<unsigned long long>(b1),
        b1 ? double(b0 - out.optimizer_bytes) / double(b1) : 0.0, o.out.c_str());
  else if (out.converted + out.imported > 0)
    std::printf("size: %llu -> %llu bytes (%.2fx smaller) written to %s\n",
                static_cast<unsigned long long>(b0), static_cast<unsigned long long>(b1),
                b1 ? double(b0) / double(b1) : 0.0, o.out.c_str());
  else
    std::printf("size: %llu bytes, every tensor copied as it was to %s\n",
                static_cast<unsigned long long>(b1), o.out.c_str());
}

// The run fails when an NF4 weight was refused, after writing the file.
void throw_if_refused(const QuantizeOptions& o, const std::vector<std::string>& refused) {
  if (refused.empty()) return;
  std::string names;
  for (const auto& n : refused) names += (names.empty() ? "'" : ", '") + n + "'";
  throw std::runtime_error(std::to_string(refused.size()) + " NF4 tensor" +
                           (refused.size() == 1 ? "" : "s") + " refused (" + names +
                           ", see above): " + o.out + " was written with " +
                           (refused.size() == 1 ? "it" : "them") + " as in " + o.in);
}

void run_quantize(const QuantizeOptions& o) {
  if (std::filesystem::is_directory(o.in)) return quantize_model_folder(o);
  if (!o.compute_dtype.empty())
    throw UsageError("--compute-dtype is for a model folder IN (a checkpoint file records none)");
  if (!o.max_shard_size.empty())
    throw UsageError("--max-shard-size is for a model folder IN (OUT is then a folder)");
  refuse_output_over_input("OUT", o.out, {{"the input checkpoint IN", o.in}});
  const QuantizePlan plan = plan_quantize(o);
  const io::SafetensorsFile in = io::load_safetensors(o.in);
  QuantizeOutput out;
  out.metadata = in.metadata;
  import_nf4_weights(in, o, plan, out);
  quantize_float_weights(in, o, plan, out);
  save_output(o, plan, out);
  print_summary(in, o, plan, out);
  std::fflush(stdout);  // the report before the error that may follow it
  throw_if_refused(o, out.refused);
}

}  // namespace

void add_quantize(CLI::App& app) {
  auto o = std::make_shared<QuantizeOptions>();
  CLI::App* sub = app.add_subcommand(
      "quantize",
      "NF4-quantize the 2-d '...weight' tensors of a safetensors checkpoint; print per-tensor "
      "RMSE / max abs error and the size before and after");
  sub->footer(
      "Examples:\n"
      "  quanta quantize runs/clf/checkpoint.safetensors runs/clf/nf4.safetensors\n"
      "  quanta quantize model.safetensors model_bnb.safetensors --format bnb --block-size 32\n"
      "  quanta quantize in.safetensors out.safetensors --exclude head --no-double-quant\n"
      "  quanta quantize models/llama models/llama-4bit   (a Hugging Face folder: the 4-bit\n"
      "      folder transformers' load_in_4bit + save_pretrained writes)");
  sub->add_option("in", o->in, "input .safetensors, or a Hugging Face model folder")->required();
  sub->add_option("out", o->out, "output .safetensors (a folder when IN is one)")->required();
  CLI::Option* format =
      sub->add_option("--format", o->format,
                      "quanta (nf4 dtype), bnb (bitsandbytes QuantState names) or torchao")
          ->capture_default_str();
  sub->add_option("--compute-dtype", o->compute_dtype,
                  "model folders: bnb_4bit_compute_dtype, auto (the model's dtype), bfloat16, "
                  "float32 or float16");
  add_max_shard_size_flag(*sub, o->max_shard_size, "model folders: the 4-bit weights");
  sub->add_option("--block-size", o->block_size,
                  "elements per scale: 32 (bnb and torchao only), 64, 128 or 256")
      ->capture_default_str();
  CLI::Option* dq = sub->add_flag(
      "--double-quant", o->double_quant,
      "double-quantize the block scales (the default for new weights; NF4 weights already in "
      "IN keep their own setting unless this or --no-double-quant is given)");
  sub->add_flag("--no-double-quant", o->no_double_quant, "keep f32 block scales")->excludes(dq);
  sub->add_option("--include", o->include, "only tensors whose name contains one of these");
  sub->add_option("--exclude", o->exclude, "skip tensors whose name contains one of these");
  sub->callback([o, format] {
    o->format_given = format->count() > 0;
    run_quantize(*o);
  });
}

}  // namespace quanta::cli
