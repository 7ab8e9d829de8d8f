#pragma once
// NF4 weights in bitsandbytes' and torchao's layouts, in memory and as
// safetensors entries. Import from bitsandbytes (with or without double
// quantization) dequantizes bit-identically to bitsandbytes.
//
// bitsandbytes' layout is also how quanta holds block-32 weights, which the
// nf4 dtype's 64-element units cannot (two scales per unit): quantize_bnb,
// dequantize(state) and nf4_linear(x, state) work on it at every block size.
#include <cstdint>
#include <map>
#include <string>

#include "engine/io/safetensors.h"
#include "engine/tensor.h"
#include "quant/nf4/nf4_format.h"

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
  /** The original weight's dtype (f32, bf16 or f16): bitsandbytes'
   * quant_state.dtype, what transformers dequantizes a loaded layer to. */
  DType dtype = DType::f32;
};

/** Quantizes a floating tensor (any shape, zero-size allowed) straight into
 * bitsandbytes' state, as its quantize_4bit does, at any NF4Options block
 * size (32 included); with double quant the exact scales are quantized
 * once. `dequant_dtype` is not part of the state. */
BnbNF4State quantize_bnb(const Tensor& x, const NF4Options& options = {});

/** Values of a bitsandbytes state, bit for bit as its dequantize_4bit:
 * dtype(float32(value(code) * scale)), dtype f32, bf16 or f16. */
Tensor dequantize(const BnbNF4State& state, DType dtype = DType::f32);

/** The f32 scale of every block, [blocks]: absmax, or with double quant
 * float32(float32(code8 * nested_absmax) + offset) as bitsandbytes computes
 * it. Throws std::invalid_argument naming what is inconsistent in `state`. */
Tensor bnb_scales(const BnbNF4State& state);

/** Bytes of the state's codes and scales (packed, absmax, nested_absmax),
 * per-tensor constants (code tables, offset, JSON) not counted. */
std::size_t bnb_payload_bytes(const BnbNF4State& state);

/** The bitsandbytes state of an nf4 tensor at `block_size` (a multiple of
 * 64; the tensor must have been quantized with it: its units repeat each
 * block's scale). With `double_quant` the stored scales are double-quantized
 * again (exact for scales that were not, a second small rounding for scales
 * that were). */
BnbNF4State to_bnb(const Tensor& nf4, bool double_quant, int64_t block_size = 64);

/** The same codes and block size with f32 scales (`double_quant` false) or
 * with the scales double-quantized (true); unchanged when it already is. */
BnbNF4State to_bnb(const BnbNF4State& state, bool double_quant);

/** An nf4 tensor from bitsandbytes state: its dequantization equals
 * bitsandbytes' dequantize_4bit bit for bit. The block size must be a
 * multiple of 64 (block-32 states stay in this layout) and quant_map the NF4
 * table. */
Tensor from_bnb(const BnbNF4State& state);

/** Adds `state` to `out` under bitsandbytes' serialisation names
 * (QuantState.as_dict(packed=True)): `name`, `name.absmax`, `name.quant_map`,
 * `name.nested_absmax`, `name.nested_quant_map` and
 * `name.quant_state.bitsandbytes__nf4` (uint8 JSON). */
void append_bnb_tensors(io::TensorMap& out, const std::string& name, const BnbNF4State& state);

/** Reads the state written by append_bnb_tensors (or by bitsandbytes) for
 * weight `name` from `tensors`; throws naming the missing entry. */
BnbNF4State read_bnb_tensors(const std::map<std::string, Tensor>& tensors, const std::string& name);

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

/** torchao's state of an nf4 tensor (block 64); needs numel % (64 * 256) ==
 * 0. */
TorchaoNF4State to_torchao(const Tensor& nf4);
/** torchao's state of a bitsandbytes state at its block size (32 included),
 * computed from its f32 scales; needs numel % (block * 256) == 0. */
TorchaoNF4State to_torchao(const BnbNF4State& state);
/** bitsandbytes' state (no double quant) holding the codes and torchao's
 * reconstructed scalers as f32 scales, at torchao's block size. */
BnbNF4State to_bnb(const TorchaoNF4State& state);
/** An nf4 tensor whose scales are torchao's reconstructed scalers (codes
 * kept; values then use bitsandbytes' table); block size a multiple of 64. */
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
