#pragma once
// NF4 (4-bit NormalFloat, QLoRA) as an engine dtype: quantize, dequantize and
// the storage layout. Semantics follow bitsandbytes' reference backend bit for
// bit (codes, scales and dequantized values), see docs/nf4.md.
//
// Storage layout of a DType::nf4 tensor of n logical elements (row-major flat
// order, like bitsandbytes: blocks cross row boundaries):
//
//   unit 0                         unit 1                     unit ceil(n/64)-1
//   +-------------------+-------+  +-------------------+-------+
//   | 32 B packed codes | f32   |  | 32 B packed codes | f32   |  ...
//   | hi nibble = even  | scale |  |                   | scale |
//   +-------------------+-------+  +-------------------+-------+
//   |<----- 36 bytes = 64 elements ---->|
//
// Every 64-element unit is self-contained: its codes and the scale that
// dequantizes them. So any byte-moving operation (copy, clone, to(device),
// save, load, broadcast, all-gather of row shards) moves bytes and nothing
// else, and a slice starting at a multiple of 64 elements (for [N, K] weights
// with K % 64 == 0: any range of whole rows) is one byte range. The padding
// of a partial last unit holds code 7 (the value 0).
//
// Options change how scales are computed, not the layout: block size 128 or
// 256 repeats the block's scale in each of its units; double quantization
// stores in each unit the f32 scale reconstructed from its 8-bit code exactly
// as bitsandbytes computes it, so dequantization is bit-identical to
// bitsandbytes'. Block size 32 needs two scales per unit (40 bytes per 64
// elements), which the 36-byte unit cannot hold: block-32 weights live in
// bitsandbytes' layout (quantize_bnb, nf4_interop.h), as does the compact
// double-quantized state (1 byte per block). bits_per_parameter says what
// each costs.
#include <array>
#include <cstddef>
#include <cstdint>

#include "engine/tensor.h"
#include "quant/kernels/nf4_layout.h"

namespace quanta::quant {

// The code table (kNF4Values), the unit's constants (kNF4UnitElems,
// kNF4CodeBytes, kNF4ScaleBytes, kNF4UnitBytes, kNF4ZeroCode) and
// nf4_midpoints() live with the kernels: quant/kernels/nf4_layout.h.

/** Blocks per double-quantization group (as bitsandbytes' nested blocksize). */
inline constexpr int64_t kNF4DoubleQuantGroup = 256;

/** Block sizes NF4Options accepts (bitsandbytes allows these and more). */
inline constexpr std::array<int64_t, 4> kNF4BlockSizes = {32, 64, 128, 256};

static_assert(
    [] {
      for (int64_t b : kNF4BlockSizes)
        if (b % 32 != 0 || (b % kNF4UnitElems != 0 && kNF4UnitElems % b != 0)) return false;
      return true;
    }(),
    "a block is whole units, or divides a unit into runs of 32 (two SIMD groups of 16)");

/** How to quantize. */
struct NF4Options {
  /** Elements sharing one scale: 32, 64 (default), 128 or 256. The nf4 dtype
   * (quantize_nf4) holds 64, 128 and 256; bitsandbytes' layout
   * (quantize_bnb) holds all four. */
  int64_t block_size = 64;
  /** Quantize the block scales to 8 bits in groups of 256 (bitsandbytes'
   * compress_statistics): numerics and export as bitsandbytes. */
  bool double_quant = true;
  /** dtype of the dequantized weight: what dequantize(q, options) returns and
   * the values NF4Linear multiplies by (bitsandbytes' compute dtype): f32,
   * bf16 or f16. */
  DType dequant_dtype = DType::f32;
};

/** Throws std::invalid_argument naming the bad option. */
void check_options(const NF4Options& options);

/** Bits per parameter of an NF4 weight; per-tensor constants (code tables,
 * the double-quant offset) are not counted. */
struct NF4Bits {
  /** As quanta holds it (in memory, its files, state dicts): 4.5 in the nf4
   * dtype (block 64, 128, 256, with or without double quant); for block 32
   * bitsandbytes' layout, the same as `bnb`. */
  double stored = 0;
  /** As bitsandbytes' layout stores it (quantize_bnb, `quanta quantize
   * --format bnb`): 4 + 32 / block, or with double quant 4 + 8 / block +
   * 32 / (256 block), 4.127 at block 64. */
  double bnb = 0;
};

/** The bits per parameter of weights quantized with `options`. */
NF4Bits bits_per_parameter(const NF4Options& options);

/** NF4 code of a value already scaled to [-1, 1]: the number of midpoints
 * between neighbouring codes strictly below it, so an exact tie takes the
 * lower code. NaN maps to 0. */
uint8_t nf4_code(float scaled);

/** Quantizes a floating tensor (any shape, zero-size allowed) to a DType::nf4
 * tensor of the same shape on its device; block size 32 throws (see
 * quantize_bnb). The codes and scales come from the device's nf4_absmax and
 * nf4_encode kernels (quant/kernels/table.h); double quantization of the
 * block scales runs on the host. */
Tensor quantize_nf4(const Tensor& x, const NF4Options& options = {});

/** Values of an nf4 tensor: float32(code value * scale), then rounded to
 * `dtype` (f32, bf16 or f16, round to nearest even). Never records a graph. */
Tensor dequantize(const Tensor& nf4, DType dtype = DType::f32);

/** dequantize(nf4, options.dequant_dtype). */
Tensor dequantize(const Tensor& nf4, const NF4Options& options);

/** dequantize() into an existing contiguous tensor on nf4's device, of the
 * same shape and of dtype f32, bf16 or f16 (no allocation: for reused
 * buffers). */
void dequantize_into(const Tensor& nf4, const Tensor& out);

/** Builds an nf4 tensor of `shape` from one 4-bit code per element (uint8
 * values 0..15, flat) and one f32 scale per `block_size` elements; built on
 * the host, returned on the codes' device. */
Tensor nf4_from_codes(const Tensor& codes, const Tensor& scales, const Shape& shape,
                      int64_t block_size = kNF4UnitElems);

/** The codes of an nf4 tensor, one uint8 per element, flat [n] (read on the
 * host, returned on nf4's device). */
Tensor nf4_codes(const Tensor& nf4);

/** The scale of every 64-element unit, f32 [ceil(n / 64)] (read on the
 * host, returned on nf4's device). */
Tensor nf4_unit_scales(const Tensor& nf4);

/** Throws std::invalid_argument("[op] ...") unless `t` is a contiguous nf4
 * tensor whose first element starts a unit (on any device: a device without
 * the op's kernel fails in its kernel table, naming the op). */
void check_nf4(const Tensor& t, const char* op);

}  // namespace quanta::quant
