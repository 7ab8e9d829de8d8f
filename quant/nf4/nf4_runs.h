#pragma once
// Internal to quant/nf4: where the codes and scales of NF4 elements live, so
// one set of kernels serves the nf4 dtype (36-byte units) and bitsandbytes'
// layout (packed codes, one scale per block; block size 32 lives only there).
//
// A run is a stretch of `run` elements (32 or 64) whose codes are contiguous
// packed bytes (high nibble = even element) and which share one f32 scale:
//   nf4 dtype:       run 64, run r = unit r (codes at 36 r, scale at 36 r + 32)
//   bitsandbytes:    run min(block, 64), codes at r * run / 2, scale of block
//                    r * run / block
// The last run may be partial; its codes then hold ceil(len / 2) bytes (more
// for the nf4 dtype, whose padding is code 7).
#include <cstdint>
#include <cstring>
#include <vector>

#include "engine/dtype.h"
#include "engine/tensor.h"

namespace quanta::quant::detail {

/** Read-only view of NF4 codes and scales, n elements in runs. */
struct NF4Runs {
  int64_t n = 0;
  int64_t run = 64;
  const uint8_t* codes = nullptr;
  int64_t code_stride = 0;
  const uint8_t* scales = nullptr;
  int64_t scale_stride = 0;
  int64_t runs_per_scale = 1;

  int64_t runs() const { return (n + run - 1) / run; }
  const uint8_t* codes_of(int64_t r) const { return codes + r * code_stride; }
  float scale_of(int64_t r) const {
    float s;
    std::memcpy(&s, scales + (r / runs_per_scale) * scale_stride, sizeof s);
    return s;
  }
};

/** The runs of a (checked) nf4 dtype tensor. */
NF4Runs unit_runs(const Tensor& nf4);

/** The runs of bitsandbytes' packed codes ((n + 1) / 2 bytes) with one f32
 * scale per `block` elements (32, or a multiple of 64). */
NF4Runs packed_runs(const uint8_t* packed, const float* scales, int64_t n, int64_t block);

/** Elements [begin, begin + count) as T (float or double): each the f32
 * product value(code) * scale rounded to `dtype` (f32, bf16 or f16). */
template <class T>
void decode_range(const NF4Runs& w, int64_t begin, int64_t count, DType dtype, T* out);

/** All n elements into `out`, an array of n values of `dtype` (f32, bf16 or
 * f16): dtype(value(code) * scale). Parallel over runs. */
void decode_all(const NF4Runs& w, DType dtype, void* out);

/** Where quantization writes: like NF4Runs, writable. `pad_runs`: a partial
 * last run is written whole (the nf4 dtype's padding codes 7); otherwise only
 * its ceil(len / 2) bytes are. `scales` (may be null): where run r's f32
 * scale goes, at scales + r * scale_stride. */
struct NF4RunsOut {
  int64_t run = 64;
  uint8_t* codes = nullptr;
  int64_t code_stride = 0;
  bool pad_runs = true;
  uint8_t* scales = nullptr;
  int64_t scale_stride = 0;
};

/** The exact max |x| of every block of `block` elements (NaN ignored). */
std::vector<float> block_absmax(const float* x, int64_t n, int64_t block);

/** Writes the codes of n f32 values in blocks of `block` (32, 64, 128 or
 * 256; a multiple of out.run) as bitsandbytes' reference computes them from
 * the exact `absmax`, and, when out.scales is set, stored[block of run] as
 * every run's scale. */
void encode_blocks(const float* x, int64_t n, int64_t block, const std::vector<float>& absmax,
                   const std::vector<float>& stored, const NF4RunsOut& out);

/** f32 contiguous CPU copy of a floating tensor; throws naming `op` otherwise. */
Tensor as_f32_cpu(const Tensor& x, const char* op);

/** Throws std::invalid_argument("[op] ...") unless dtype is f32, bf16 or f16. */
void check_dequant_dtype(DType dtype, const char* op);

}  // namespace quanta::quant::detail
