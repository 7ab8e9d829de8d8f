#pragma once
// The NF4 storage layout as raw bytes: the code table, the 36-byte unit and
// the run view every NF4 kernel reads and writes. No Tensor here, so the
// kernels of every device (quant/cpu/, quant/cuda/) share it with the format
// (quant/nf4/nf4_format.h, which re-exports it and documents the layout).
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace quanta::quant {

/** The 16 NF4 values, index = 4-bit code, as float32 (bitsandbytes' table). */
inline constexpr std::array<float, 16> kNF4Values = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

/** Elements in one storage unit. */
inline constexpr int64_t kNF4UnitElems = 64;
/** Bytes of packed codes in one unit (two codes per byte). */
inline constexpr std::size_t kNF4CodeBytes = kNF4UnitElems / 2;
/** Bytes of the f32 scale that closes each unit. */
inline constexpr std::size_t kNF4ScaleBytes = sizeof(float);
/** Bytes of one unit. */
inline constexpr std::size_t kNF4UnitBytes = kNF4CodeBytes + kNF4ScaleBytes;
/** Code of the value 0, used for padding. */
inline constexpr uint8_t kNF4ZeroCode = 7;

/** Rows up to which nf4_linear uses the fused decode-and-dot path. */
inline constexpr int64_t kNF4FusedMaxBatch = 8;

/** Elements of one dequantized weight tile on the tiled path (4 MiB of f32). */
inline constexpr int64_t kNF4TileElems = int64_t{1} << 20;

static_assert(kNF4UnitElems % 2 == 0, "two codes per byte");
static_assert(kNF4UnitBytes == 36, "the nf4 dtype row says 36 bytes per 64 elements");
static_assert(kNF4Values[kNF4ZeroCode] == 0.0f, "padding code dequantizes to 0");
static_assert(kNF4Values.front() == -1.0f && kNF4Values.back() == 1.0f,
              "codes span [-1, 1] so +-absmax map to codes 15 and 0");

/** The 15 midpoints float32((v[i] + v[i+1]) / 2) the rounding uses. */
inline const std::array<float, 15>& nf4_midpoints() {
  static const std::array<float, 15> mids = [] {  // immutable once built
    std::array<float, 15> m{};
    for (size_t i = 0; i < m.size(); ++i) m[i] = (kNF4Values[i] + kNF4Values[i + 1]) / 2.0f;
    return m;
  }();
  return mids;
}

// Where the codes and scales of NF4 elements live, so one set of kernels
// serves the nf4 dtype (36-byte units) and bitsandbytes' layout (packed
// codes, one scale per block; block size 32 lives only there).
//
// A run is a stretch of `run` elements (32 or 64) whose codes are contiguous
// packed bytes (high nibble = even element) and which share one f32 scale:
//   nf4 dtype:       run 64, run r = unit r (codes at 36 r, scale at 36 r + 32)
//   bitsandbytes:    run min(block, 64), codes at r * run / 2, scale of block
//                    r * run / block
// The last run may be partial; its codes then hold ceil(len / 2) bytes (more
// for the nf4 dtype, whose padding is code 7). The pointers are on the
// device whose kernel reads them.

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

/** The runs of nf4 dtype units (36 bytes per 64 elements) at `units`. */
inline NF4Runs nf4_unit_runs(const uint8_t* units, int64_t n) {
  NF4Runs w;
  w.n = n;
  w.run = kNF4UnitElems;
  w.codes = units;
  w.code_stride = static_cast<int64_t>(kNF4UnitBytes);
  w.scales = w.codes ? w.codes + kNF4CodeBytes : nullptr;
  w.scale_stride = static_cast<int64_t>(kNF4UnitBytes);
  return w;
}

/** The runs of bitsandbytes' packed codes ((n + 1) / 2 bytes) with one f32
 * scale per `block` elements (32, or a multiple of 64). */
inline NF4Runs nf4_packed_runs(const uint8_t* packed, const float* scales, int64_t n,
                               int64_t block) {
  NF4Runs w;
  w.n = n;
  w.run = block < kNF4UnitElems ? block : kNF4UnitElems;
  w.codes = packed;
  w.code_stride = w.run / 2;
  w.scales = reinterpret_cast<const uint8_t*>(scales);
  w.scale_stride = sizeof(float);
  w.runs_per_scale = block / w.run;
  return w;
}

}  // namespace quanta::quant
