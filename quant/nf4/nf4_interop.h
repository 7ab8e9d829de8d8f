#pragma once
// NF4 tensors in bitsandbytes' and torchao's layouts, in memory and as
// safetensors entries. Import from bitsandbytes (with or without double
// quantization) dequantizes bit-identically to bitsandbytes.
#include <cstdint>
#include <map>
#include <string>

#include "engine/io/safetensors.h"
#include "engine/tensor.h"

namespace quanta::quant {

/** bitsandbytes' state of one 4-bit NF4 weight (Params4bit + QuantState). */
struct BnbNF4State {
  /** uint8 [(n + 1) / 2, 1]: byte j = code[2j] << 4 | code[2j + 1]. */
  Tensor packed;
  /** f32 [blocks]; with double quant the uint8 8-bit codes of the scales. */
  Tensor absmax;
  /** f32 [16], the NF4 values. */
  Tensor quant_map;
  /** Double quant only: f32 [groups] second-level scales, f32 [256] code
   * table, and the offset added back. */
  Tensor nested_absmax;
  Tensor nested_quant_map;
  float nested_offset = 0;
  bool double_quant = false;
  int64_t blocksize = 64;
  int64_t nested_blocksize = 256;
  /** Shape of the original weight. */
  Shape shape;
};

/** The bitsandbytes state of an nf4 tensor, block size 64. With
 * `double_quant` the stored scales are double-quantized again (exact for
 * scales that were not, a second small rounding for scales that were). */
BnbNF4State to_bnb(const Tensor& nf4, bool double_quant);

/** An nf4 tensor from bitsandbytes state: its dequantization equals
 * bitsandbytes' dequantize_4bit bit for bit. The block size must be a
 * multiple of 64 and quant_map the NF4 table. */
Tensor from_bnb(const BnbNF4State& state);

/** Adds `state` to `out` under bitsandbytes' serialisation names
 * (QuantState.as_dict(packed=True)): `name`, `name.absmax`, `name.quant_map`,
 * `name.nested_absmax`, `name.nested_quant_map` and
 * `name.quant_state.bitsandbytes__nf4` (uint8 JSON). */
void append_bnb_tensors(io::TensorMap& out, const std::string& name,
                        const BnbNF4State& state);

/** Reads the state written by append_bnb_tensors (or by bitsandbytes) for
 * weight `name` from `tensors`; throws naming the missing entry. */
BnbNF4State read_bnb_tensors(const std::map<std::string, Tensor>& tensors,
                             const std::string& name);

/** True when `tensors` holds a bitsandbytes NF4 weight called `name`. */
bool has_bnb_tensors(const std::map<std::string, Tensor>& tensors, const std::string& name);

/** torchao NF4Tensor state (always double-quantized, linear int8 scales).
 * torchao's code table has 4 decimals, so its dequantization differs from
 * bitsandbytes' by up to 5e-5 of the block scale. */
struct TorchaoNF4State {
  /** uint8 [n / 2], same nibble order as bitsandbytes. */
  Tensor quantized_data;
  /** int8 [blocks] stored as their uint8 bit patterns. */
  Tensor quantized_scalers;
  /** f32 [blocks / scaler_block_size]. */
  Tensor quantization_factor;
  /** f32 0-d. */
  Tensor scaler_mean;
  /** f32 [16], torchao's NF4 table. */
  Tensor nf4;
  int64_t block_size = 64;
  int64_t scaler_block_size = 256;
  Shape shape;
};

/** torchao's state of an nf4 tensor; needs numel % (64 * 256) == 0. */
TorchaoNF4State to_torchao(const Tensor& nf4);
/** An nf4 tensor whose scales are torchao's reconstructed scalers (codes
 * kept; values then use bitsandbytes' table). */
Tensor from_torchao(const TorchaoNF4State& state);
/** torchao's own dequantization in f32 (its table, its scaler arithmetic). */
Tensor torchao_dequantize(const TorchaoNF4State& state);

/** Adds `state` under `name.quantized_data`, `name.quantized_scalers`, ...;
 * the shape and block sizes go into `metadata["name.torchao_nf4"]` (JSON). */
void append_torchao_tensors(io::TensorMap& out, std::map<std::string, std::string>& metadata,
                            const std::string& name, const TorchaoNF4State& state);
/** Reads what append_torchao_tensors wrote. */
TorchaoNF4State read_torchao_tensors(const std::map<std::string, Tensor>& tensors,
                                     const std::map<std::string, std::string>& metadata,
                                     const std::string& name);

}  // namespace quanta::quant
