#include "quantize_folder.h"

#include <cstdio>
#include <filesystem>
#include <iostream>

#include "commands.h"
#include "finetune/run.h"
#include "flag_checks.h"
#include "llm/model/config.h"
#include "llm/model/model_folder.h"
#include "llm/model/weight_names.h"
#include "llm/qlora/bnb_folder.h"
#include "llm/qlora/qlora_model.h"
#include "peak_memory.h"

namespace quanta::cli {

namespace fs = std::filesystem;

void run_quantize_folder(const QuantizeFolderOptions& o) {
  if (o.block_size != 64)
    throw UsageError("--block-size " + std::to_string(o.block_size) +
                     ": a model folder is quantized as transformers' load_in_4bit does, in "
                     "blocks of 64");
  const llm::SaveOptions save{.max_shard_bytes = max_shard_size_flag(o.max_shard_size)};
  refuse_output_over_input(
      "OUT", (fs::path(o.out) / "model.safetensors").string(),
      {{"the model folder IN", (fs::path(o.in) / "model.safetensors").string()}});
  if (fs::exists(fs::path(o.out) / "config.json") &&
      fs::equivalent(fs::path(o.out) / "config.json", fs::path(o.in) / "config.json"))
    throw UsageError("OUT " + o.out + " is the model folder IN");
  // Each layer's float weights are read as it is quantized: a model larger
  // than memory in float converts within its 4-bit size.
  auto model = llm::load_causal_lm(o.in, Device::cpu(), {.defer_layer_weights = true});
  llm::BaseQuantization q;
  q.blocksize = o.block_size;
  q.double_quant = o.double_quant;
  q.compute_dtype = compute_dtype_flag(o.compute_dtype, model->config().dtype);
  const llm::QLoRAReport report = llm::quantize_base(*model, q);
  // An image-text model's vision tower goes beside, as the folder stores it.
  llm::save_bnb_folder(*model, q, o.out, llm::read_non_decoder_weights(model->config(), o.in),
                       save);
  llm::copy_tokenizer_files(o.in, o.out);
  uint64_t before = 0, after = 0;
  for (const llm::QLoRALayer& l : report.layers) {
    std::printf("%-44s %-12s %12s -> %10s bytes\n", l.name.c_str(), shape_str(l.shape).c_str(),
                with_commas(l.bytes_before).c_str(), with_commas(l.bytes_after).c_str());
    before += l.bytes_before;
    after += l.bytes_after;
  }
  // The peak says what converting took: about the 4-bit model, not the float one.
  const int64_t peak = peak_rss_bytes();
  std::printf(
      "%s: %zu linear layers (all but lm_head) in NF4, block %lld, %s, compute %s: %s -> %s "
      "bytes%s\n",
      o.out.c_str(), report.layers.size(), static_cast<long long>(o.block_size),
      o.double_quant ? "double quant" : "f32 scales", llm::torch_dtype_name(q.compute_dtype),
      with_commas(before).c_str(), with_commas(after).c_str(),
      peak < 0 ? "" : ("; peak resident memory " + with_commas(uint64_t(peak)) + " bytes").c_str());
}

}  // namespace quanta::cli
