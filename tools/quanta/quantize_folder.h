#pragma once
// `quanta quantize MODEL_DIR OUT_DIR`: a Hugging Face model folder to the
// 4-bit folder transformers' load_in_4bit + save_pretrained writes (every
// linear layer but lm_head in bitsandbytes' NF4 layout, the rest as it is,
// config.json with quantization_config), loadable by from_pretrained.
#include <cstdint>
#include <string>

namespace quanta::cli {

struct QuantizeFolderOptions {
  std::string in, out;
  int64_t block_size = 64;
  bool double_quant = true;
  /** --compute-dtype (compute_dtype_flag). */
  std::string compute_dtype = "auto";
  /** --max-shard-size (max_shard_size_flag). */
  std::string max_shard_size;
};

void run_quantize_folder(const QuantizeFolderOptions& o);

}  // namespace quanta::cli
