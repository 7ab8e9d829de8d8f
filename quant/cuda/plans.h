#pragma once
// How the CUDA quantizer kernels split their work: tiles and chunk counts,
// computed on the host. Plain C++ so the CPU tests check them; the .cu files
// only follow them. Grid sizes come from engine/cuda/launch.h.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "engine/dtype.h"
#include "engine/kernels/functors.h"  // QUANTA_HD
#include "quant/kernels/nf4_layout.h"

namespace quanta::quant::quant_cuda {

/** Rows per squared_error partial sum: the contract's 256-row chunks. */
inline constexpr int64_t kSquaredErrorChunk = 256;

/** Elements of scratch a nearest_codes score tile may take (64 MiB of f32). */
inline constexpr int64_t kNearestTileElems = int64_t{1} << 24;

/** Elements of a score tile that the L2 cache (50 MB on the H100 and H200)
 * holds when the argmin pass reads it just after the GEMM wrote it, the
 * next tile's GEMM overwriting its lines there: 16 MiB of f32. Tiles shrink
 * to it while they keep kNearestMinTileRows rows. With one 32 MiB tile for
 * 8192 rows against 1024 codes, written to DRAM and read back, the search
 * took 1.34x its GEMM on an H100 (2026-12-05), the argmin pass some 30 us
 * at about 1.1 TB/s. Not yet timed at this size. */
inline constexpr int64_t kNearestL2TileElems = int64_t{1} << 22;

/** Rows a tile keeps at least before it shrinks toward the L2's size: the
 * argmin pass gives each row a warp, and 4096 warps are some 31 an SM on
 * 132, enough loads in flight; a quarter of that would leave the pass
 * waiting on latency (the 16384-code search, at 1.14x its GEMM, keeps its
 * tiles of 4096 rows by 4096 codes). */
inline constexpr int64_t kNearestMinTileRows = 4096;

/** Codes per nearest_codes tile at most: a warp scans each row's tile, and
 * a codebook larger than this is searched tile by tile. */
inline constexpr int64_t kNearestMaxCodes = 4096;

/** Elements of scratch one dequantized nf4_linear weight tile may take
 * (16 MiB of f32: 1024 rows of 4096 already make a full-size GEMM). */
inline constexpr int64_t kNF4GpuTileElems = int64_t{1} << 22;

/** The threads of one warp, which the row kernels give each row. */
inline constexpr int kWarp = 32;

/** The f64 partial sums of squared_error: one per 256-row chunk. */
inline int64_t squared_error_chunks(int64_t rows) {
  return rows <= 0 ? 0 : (rows + kSquaredErrorChunk - 1) / kSquaredErrorChunk;
}

/** A nearest_codes tiling: scores of `rows` x rows by `codes` codes at a
 * time, rows * codes <= the budget (at least one of each). */
struct NearestTiles {
  int64_t rows = 0;
  int64_t codes = 0;
};

/** Tiles for n rows against k codes within `budget` score elements: as many
 * codes as fit, up to kNearestMaxCodes, then as many rows as fit beside
 * them, fewer where kNearestL2TileElems holds the tile and it keeps
 * kNearestMinTileRows rows. Zero tiles when there is nothing to search. */
inline NearestTiles nearest_tiles(int64_t n, int64_t k, int64_t budget = kNearestTileElems) {
  NearestTiles t;
  if (n <= 0 || k <= 0) return t;
  budget = std::max<int64_t>(budget, 1);
  t.codes = std::min({k, budget, kNearestMaxCodes});
  const int64_t in_l2 = std::max(kNearestL2TileElems / t.codes, kNearestMinTileRows);
  t.rows = std::max<int64_t>(1, std::min({n, budget / t.codes, in_l2}));
  return t;
}

// ---- LFQ's clamped entropy ----

/** Bits up to which the CUDA entry walks a token in one thread
 * (quant/kernels/entropy_walk.h): its scratch, 4 arrays of d and d + 1
 * stack frames, lives in the thread's local memory (about 4.7 KiB at 64).
 * LFQ codebooks of 2^64 codes are beyond any use; wider rows are staged
 * through the host. */
inline constexpr int64_t kEntropyWalkMaxBits = 64;

// ---- code_statistics (the codebook EMA's counts and sums) ----

/** Sorted rows per piece of code_statistics' sums on CUDA: about sqrt(n), a
 * power of two in [32, 1024]. A piece is walked row by row, and a code whose
 * rows span several pieces is finished by adding its pieces' parts in order:
 * at about sqrt(n) each, neither walk is long even when every row has the
 * same code. It depends on n alone, so the sums' bits do too. */
inline int64_t code_stats_piece_rows(int64_t n) {
  int64_t p = 32;
  while (p < 1024 && p * p < n) p *= 2;
  return p;
}

/** Threads per code_statistics piece block: a thread per column, in whole
 * warps, at most 256 (more columns loop). */
inline int code_stats_threads(int64_t d) {
  return static_cast<int>(std::clamp<int64_t>((d + kWarp - 1) / kWarp * kWarp, kWarp, 256));
}

/** Weight rows per dequantized nf4_linear tile of `k` columns within
 * `budget` elements (at least 1, at most n_rows; 0 when there is nothing). */
inline int64_t nf4_tile_rows(int64_t n_rows, int64_t k, int64_t budget = kNF4GpuTileElems) {
  if (n_rows <= 0 || k <= 0) return 0;
  return std::max<int64_t>(1, std::min(n_rows, budget / k));
}

// ---- nf4_linear's fused GEMV (small batches) ----
//
// For m <= kNF4GemvMaxBatch rows of x, nf4_linear reads each packed weight
// byte once and dequantizes it in registers: at 0.5625 bytes per weight (4-bit
// codes and an f32 scale per 64) against a bf16 GEMV's 2, it moves about 3.6x
// fewer bytes. A batch only reuses each decoded weight m times, so past a few
// rows the dequantized tile + cuBLAS GEMM, which reuses it across the whole
// batch from its own tiles, wins; 8 is the CPU's threshold (kNF4FusedMaxBatch)
// and a first choice here, to be timed against the tiled path on a GPU.

/** Rows of x up to which nf4_linear runs the fused GEMV on CUDA. */
inline constexpr int64_t kNF4GemvMaxBatch = kNF4FusedMaxBatch;

/** Codes a lane decodes per step: one 32-bit word of packed codes. */
inline constexpr int64_t kNF4GemvCodesPerLane = 8;

/** Columns a warp covers per step: 32 lanes x 8 codes. */
inline constexpr int64_t kNF4GemvStep = kWarp * kNF4GemvCodesPerLane;

/** Steps whose words of codes a GEMV lane loads (every weight row of its
 * warp) before it decodes any: with one step, each row's word was decoded
 * before the next one's load was issued, a warp then waiting a DRAM round
 * trip per row and step (0.9 TB/s on the H200). */
inline constexpr int kNF4GemvStepsInFlight = 4;

/** Warps per GEMV block; they share the block's staged columns of x. */
inline constexpr int kNF4GemvWarps = 8;

/** Blocks of a GEMV kernel that must fit on one multiprocessor, the
 * registers a thread may take following (the compiler's __launch_bounds__):
 * 4 for f32 and one row of x (two spill at 64), else 1 (no limit). An 8192-row product
 * is 512 blocks; at 78 registers 3 fitted, so the 132 SMs of an H100 ran 396
 * blocks and then 116, the second wave's length mostly idle (ncu, 2026-12-05:
 * 37.5% theoretical occupancy, limited by registers). At 64, 4 fit: 528. */
constexpr int nf4_gemv_min_blocks(int64_t elem_bytes, int batch) {
  return elem_bytes == 4 && batch == 1 ? 4 : 1;
}

/** Weight rows each warp computes together, so every x value it loads from
 * shared memory serves that many rows. */
inline constexpr int kNF4GemvRowsPerWarp = 2;

/** Weight rows per GEMV block. */
inline constexpr int64_t kNF4GemvBlockRows = kNF4GemvWarps * kNF4GemvRowsPerWarp;

/** Shared memory the staged x may take per block (32 KiB: several blocks fit
 * on a multiprocessor, which a memory-bound kernel needs to hide latency). */
inline constexpr int64_t kNF4GemvSmemBytes = int64_t{32} << 10;

/** Most GEMV blocks launched; a grid-stride loop takes further rows. */
inline constexpr int64_t kNF4GemvMaxBlocks = int64_t{1} << 16;

/** Elements of padding after every lane's 8 staged values of x: 16 bytes.
 * A warp's 16-byte shared-memory loads go 8 lanes at a time over the 32
 * banks (8 groups of 16 bytes); padded, lane l's values start at 16-byte unit
 * 3 l (f32) or 5 l (f64), distinct mod 8, so those 8 lanes never conflict. */
inline constexpr int64_t nf4_gemv_pad(int64_t elem_bytes) { return 16 / elem_bytes; }

/** Where element k of a staged row of x lies: its lane group of 8, padded. */
inline constexpr int64_t nf4_gemv_slot(int64_t k, int64_t elem_bytes) {
  return k / kNF4GemvCodesPerLane * (kNF4GemvCodesPerLane + nf4_gemv_pad(elem_bytes)) +
         k % kNF4GemvCodesPerLane;
}

/** A GEMV lane's place in one weight row: the 32-bit word of codes at its
 * column and the f32 scale of that column's run, moved a step (kNF4GemvStep
 * columns) at a time by additions alone. Formed per word from the run's
 * index, a 64-bit product and a division per word, they took some 25
 * instructions a word, about 3 of every code's 10. */
struct NF4GemvCursor {
  const uint8_t* codes = nullptr;
  const uint8_t* scale = nullptr;
  int32_t scale_rem = 0;  // the run's index mod runs_per_scale (32 bits: fewer registers)
};

/** What one step adds to every cursor of a weight of `run` (32 or 64)
 * codes per run: kNF4GemvStep / run runs. */
struct NF4GemvSteps {
  int64_t code_bytes = 0;   // (runs a step) x code_stride
  int64_t scale_bytes = 0;  // (runs a step / runs_per_scale) x scale_stride
  int32_t scale_rem = 0;    // (runs a step) mod runs_per_scale
  int32_t runs_per_scale = 1;
  int64_t scale_stride = 0;
};

QUANTA_HD inline NF4GemvSteps nf4_gemv_steps(const NF4Runs& w, int64_t run) {
  const int64_t runs = kNF4GemvStep / run;
  NF4GemvSteps st;
  st.code_bytes = runs * w.code_stride;
  st.scale_bytes = runs / w.runs_per_scale * w.scale_stride;
  st.scale_rem = static_cast<int32_t>(runs % w.runs_per_scale);
  st.runs_per_scale = static_cast<int32_t>(w.runs_per_scale);
  st.scale_stride = w.scale_stride;
  return st;
}

/** The cursor of weight row `row` (runs_per_row runs of `run` codes) at
 * column `col`, a multiple of kNF4GemvCodesPerLane. */
QUANTA_HD inline NF4GemvCursor nf4_gemv_cursor(const NF4Runs& w, int64_t run, int64_t row,
                                               int64_t runs_per_row, int64_t col) {
  const int64_t r = row * runs_per_row + col / run;
  NF4GemvCursor c;
  c.codes = w.codes + r * w.code_stride + col % run / 2;
  c.scale = w.scales + r / w.runs_per_scale * w.scale_stride;
  c.scale_rem = static_cast<int32_t>(r % w.runs_per_scale);
  return c;
}

/** Moves c one step on: kNF4GemvStep columns further in the same row. */
QUANTA_HD inline void nf4_gemv_advance(NF4GemvCursor& c, const NF4GemvSteps& st) {
  c.codes += st.code_bytes;
  c.scale += st.scale_bytes;
  if (st.runs_per_scale > 1) {  // several runs a scale (bitsandbytes' blocks of 128 and more)
    c.scale_rem += st.scale_rem;
    if (c.scale_rem >= st.runs_per_scale)
      c.scale_rem -= st.runs_per_scale, c.scale += st.scale_stride;
  }
}

/** The GEMV's kernels, one walk: each lane decodes one 32-bit word (8
 * codes) per weight row and step, the words of several steps loaded before
 * any is decoded. `staged`: per pass a block stages columns of x in shared
 * memory, each value read from global memory once per block. `unstaged`: x
 * is read straight from global memory, through the L1 cache the
 * multiprocessor's warps share: no passes and no barriers, and lanes' loads
 * of x 32 bytes apart. At one row of x `unstaged` was the faster on an H100
 * (2026-12-05: 37 us against 43 for 8192 x 8192, 38 against 42 captured),
 * so it is the default there; more rows keep `staged` until a GPU has timed
 * them (QUANTA_NF4_GEMV chooses; `quanta bench nf4 --device cuda` times both
 * at one row). (The first other kernel, `wide`, four words a lane, read x 128 bytes
 * apart across lanes, 32 cache lines a load: 1.2x slower on the H200.)
 * `fixed`: `unstaged`'s walk with what the others read at run time fixed at
 * compile time (NF4GemvWalk: the steps' byte strides, a scale per word with
 * no carry between runs; the dequant dtype), for f32 x of one row (else it
 * runs `unstaged`): the same grid, rows and loads. Read in SASS, the
 * unstaged kernel spent some 6.7 instructions a code (a branch per word for
 * a scale that may span runs, the dequant dtype's three paths, 64-bit
 * address sums per load), which at the 40% issue rate ncu saw is its 37 us;
 * at 4 blocks an SM the issue alone of those instructions takes some 15 us
 * of an H100, the goal (a third of cuBLAS's 49 us) 16. `fixed` takes 4.5
 * with an f32 dequant dtype (the 16-bit ones round two values with one
 * conversion). Same sums, same bits. (Four rows a warp took 4.3, its x
 * loads serving twice the rows, but an 8192-row product would then have 256
 * blocks, half of what 4 an SM on 132 holds: half the warps to hide latency.) */
enum class NF4GemvKind { staged, unstaged, fixed };

/** The kernel QUANTA_NF4_GEMV names ("staged", "unstaged" or "fixed"; unset
 * or empty: unstaged for one row of x, staged for more); throws
 * std::invalid_argument naming the variable for any other value. Read on
 * every call, so a benchmark can time each in one process. */
inline NF4GemvKind nf4_gemv_kind_from(const char* env_value, int64_t rows) {
  const std::string v = env_value ? env_value : "";
  if (v.empty()) return rows == 1 ? NF4GemvKind::unstaged : NF4GemvKind::staged;
  if (v == "staged") return NF4GemvKind::staged;
  if (v == "unstaged") return NF4GemvKind::unstaged;
  if (v == "fixed") return NF4GemvKind::fixed;
  throw std::invalid_argument("QUANTA_NF4_GEMV must be staged, unstaged or fixed, got '" + v + "'");
}

/** The layouts whose step strides the `fixed` kernel takes as constants:
 * `units`, the nf4 dtype's 36-byte units (32 bytes of 64 codes, then their
 * f32 scale: a step of 256 codes moves both 144 bytes); `packedB`,
 * bitsandbytes' packed codes (a step moves them 128 bytes) with an f32
 * scale per B elements (256 / B scales a step). `none`: any other, among
 * them blocks of 512 and more, whose scale spans several steps. */
enum class NF4GemvWalk { none, units, packed32, packed64, packed128, packed256 };

/** The walk of w (nf4_word_aligned). */
inline NF4GemvWalk nf4_gemv_walk(const NF4Runs& w) {
  const auto unit = static_cast<int64_t>(kNF4UnitBytes);
  if (w.run == kNF4UnitElems && w.runs_per_scale == 1 && w.code_stride == unit &&
      w.scale_stride == unit && w.codes && w.scales == w.codes + kNF4CodeBytes)
    return NF4GemvWalk::units;
  if (w.code_stride != w.run / 2 || w.scale_stride != int64_t{sizeof(float)})
    return NF4GemvWalk::none;
  switch (w.run * w.runs_per_scale) {
    case 32:
      return NF4GemvWalk::packed32;
    case 64:
      return NF4GemvWalk::packed64;
    case 128:
      return NF4GemvWalk::packed128;
    case 256:
      return NF4GemvWalk::packed256;
    default:
      return NF4GemvWalk::none;
  }
}

/** What a step (kNF4GemvStep columns) adds to a lane's code and scale
 * addresses under `walk` (not none): nf4_gemv_steps' figures for such a
 * layout, with no carry (scale_rem 0), as constants. */
struct NF4GemvFixedSteps {
  int code_bytes = 0;
  int scale_bytes = 0;
};

QUANTA_HD constexpr NF4GemvFixedSteps nf4_gemv_fixed_steps(NF4GemvWalk walk) {
  constexpr int unit_step = static_cast<int>(kNF4GemvStep / kNF4UnitElems * kNF4UnitBytes);
  constexpr int packed_step = static_cast<int>(kNF4GemvStep / 2);
  constexpr int scale = static_cast<int>(sizeof(float));
  switch (walk) {
    case NF4GemvWalk::units:
      return {unit_step, unit_step};
    case NF4GemvWalk::packed32:
      return {packed_step, scale * static_cast<int>(kNF4GemvStep / 32)};
    case NF4GemvWalk::packed64:
      return {packed_step, scale * static_cast<int>(kNF4GemvStep / 64)};
    case NF4GemvWalk::packed128:
      return {packed_step, scale * static_cast<int>(kNF4GemvStep / 128)};
    case NF4GemvWalk::packed256:
      return {packed_step, scale * static_cast<int>(kNF4GemvStep / 256)};
    default:
      return {};
  }
}

/** The kernel that runs when `asked` is asked for m rows of x of elem_bytes
 * elements at an address 16-byte aligned or not, against a weight of walk
 * `walk`: `fixed` takes f32 x of one row and a walk (else `unstaged`); the
 * unstaged kernels' 16-byte loads of x need it aligned (rows are: k is whole
 * runs), so an offset view takes `staged`. */
inline NF4GemvKind nf4_gemv_kind_for(NF4GemvKind asked, int64_t m, int64_t elem_bytes,
                                     NF4GemvWalk walk, bool x_aligned) {
  NF4GemvKind kind = asked;
  if (kind == NF4GemvKind::fixed && (m != 1 || elem_bytes != 4 || walk == NF4GemvWalk::none))
    kind = NF4GemvKind::unstaged;
  if (!x_aligned) kind = NF4GemvKind::staged;
  return kind;
}

/** How a fused GEMV runs: `staged` stages `chunk` columns of x (a multiple
 * of kNF4GemvStep) per pass in `smem_bytes` of shared memory; `unstaged` and `fixed` stage
 * nothing (chunk = k, smem_bytes 0). `blocks` blocks either way. */
struct NF4GemvPlan {
  NF4GemvKind kind = NF4GemvKind::staged;
  int64_t chunk = 0;
  int64_t smem_bytes = 0;
  int64_t blocks = 0;
};

/** Whether every run's code bytes and f32 scale can be read as aligned 32-bit
 * words: base pointers and strides multiples of 4 (both layouts' are, on
 * allocations the engine makes), runs of 32 or 64. */
inline bool nf4_word_aligned(const NF4Runs& w) {
  const auto aligned = [](const void* p, int64_t stride) {
    return reinterpret_cast<uintptr_t>(p) % 4 == 0 && stride % 4 == 0;
  };
  return (w.run == 32 || w.run == 64) && aligned(w.codes, w.code_stride) &&
         aligned(w.scales, w.scale_stride);
}

/** Whether nf4_linear's product y [m, n] = x [m, k] W^T takes the fused GEMV:
 * 1 <= m <= kNF4GemvMaxBatch, and every weight row whole runs of 32 or 64
 * codes (k % run == 0, as the CPU's fused path needs) whose code bytes and
 * scales can be read as aligned 32-bit words. Otherwise: the tiled path. */
inline bool nf4_use_gemv(int64_t m, int64_t k, int64_t n, const NF4Runs& w) {
  return m >= 1 && m <= kNF4GemvMaxBatch && k >= 1 && n >= 1 && k % w.run == 0 &&
         nf4_word_aligned(w);
}

/** Whether nf4_linear's tiled path (forward and backward) multiplies in
 * bf16 on the tensor cores: f32 data, dequant dtype bf16, and more rows
 * than the fused GEMV takes. As bitsandbytes' bnb_4bit_compute_dtype=bfloat16
 * and the CPU's path where it has bf16 products (quant/cpu/nf4_linear_kernels
 * .cpp): the activation (x forward, g backward) rounded to bf16 once, the
 * weight decoded to bf16 (exact: its values are bf16 already), f32 sums, an
 * f32 result. Otherwise the tiled path's product is f32 (SGEMM). */
inline bool nf4_bf16_products(bool f32_data, DType dequant, int64_t m) {
  return f32_data && dequant == DType::bf16 && m > kNF4GemvMaxBatch;
}

// ---- nf4_decode (dequantize, and the tiled path's weight tiles) ----
//
// Dequantizing moves 0.5625 bytes in per 4 (f32) or 2 (bf16, f16) bytes out,
// so its floor is the writes. A thread per 16 bytes of output reads its
// packed 32-bit word of codes and its run's scale, decodes its values in
// registers and writes them as one 16-byte store, so each store instruction
// of a warp writes 512 contiguous bytes, whole 32-byte sectors. (A thread
// per word wrote an f32 word's 32 bytes as two 16-byte stores, each
// instruction then half of every sector it touched: the H200 dequantized to
// f32 at 58% of copy bandwidth, to bf16, one store a word, at 84%.) One
// thread per element (the general kernel) would read each code byte twice
// and the scale 64 times, with 4- or 2-byte stores.

/** Elements one word of packed codes holds. */
inline constexpr int64_t kNF4WordCodes = 8;

/** Bytes each thread of the word kernel stores. */
inline constexpr int64_t kNF4DecodeStoreBytes = 16;

/** Codes each thread of the word kernel decodes for outputs of elem_bytes
 * (2, 4 or 8): 8, 4 or 2, a whole word or a part that never leaves it. */
constexpr int64_t nf4_decode_thread_codes(int64_t elem_bytes) {
  return kNF4DecodeStoreBytes / elem_bytes;
}

/** Where thread t of the word kernel reads and writes: word `word` of the
 * split's words, its codes first_code .. first_code + codes - 1, written at
 * element t * codes of the output (16-byte aligned, as the split's output). */
struct NF4DecodePiece {
  int64_t word = 0;
  int first_code = 0;
};

// constexpr: nvcc's --expt-relaxed-constexpr lets the kernel call it.
template <int64_t ElemBytes>
constexpr NF4DecodePiece nf4_decode_piece(int64_t t) {
  constexpr int64_t codes = nf4_decode_thread_codes(ElemBytes);
  constexpr int64_t per_word = kNF4WordCodes / codes;
  static_assert(codes * ElemBytes == kNF4DecodeStoreBytes && kNF4WordCodes % codes == 0,
                "a thread's codes fill its store and lie in one word");
  return {t / per_word, static_cast<int>(t % per_word * codes)};
}

/** Threads of the word kernel for `words` words to outputs of elem_bytes. */
constexpr int64_t nf4_decode_threads(int64_t words, int64_t elem_bytes) {
  return words * kNF4WordCodes / nf4_decode_thread_codes(elem_bytes);
}

/** How nf4_decode covers elements [begin, begin + count): `words` whole
 * words from `begin` by the word kernel (nf4_decode_piece), then the elements from `tail_begin`
 * (`tail_count` of them) a thread each. No words when begin is not on a word,
 * the runs cannot be read as words (nf4_word_aligned), or the output is not
 * 16-byte aligned (the word kernel's vector stores). */
struct NF4DecodeSplit {
  int64_t words = 0;
  int64_t tail_begin = 0;
  int64_t tail_count = 0;
};

inline NF4DecodeSplit nf4_decode_split(const NF4Runs& w, int64_t begin, int64_t count,
                                       const void* out) {
  NF4DecodeSplit s;
  if (count <= 0) return s;
  const bool by_words = begin % kNF4WordCodes == 0 && nf4_word_aligned(w) &&
                        reinterpret_cast<uintptr_t>(out) % 16 == 0;
  s.words = by_words ? count / kNF4WordCodes : 0;
  s.tail_begin = begin + s.words * kNF4WordCodes;
  s.tail_count = count - s.words * kNF4WordCodes;
  return s;
}

/** The GEMV's plan for m rows of x of k columns (elements of elem_bytes: 4 or
 * 8) against n weight rows. `unstaged`: one pass over all k columns, a
 * block per kNF4GemvBlockRows weight rows, at most kNF4GemvMaxBlocks;
 * `fixed` the same.
 * `staged`: the widest chunk of columns whose padded rows fit
 * kNF4GemvSmemBytes (at least one step; no wider than k rounded up to a step),
 * and a block per kNF4GemvBlockRows weight rows, at most kNF4GemvMaxBlocks. */
inline NF4GemvPlan nf4_gemv_plan(int64_t m, int64_t k, int64_t n, int64_t elem_bytes,
                                 NF4GemvKind kind = NF4GemvKind::staged) {
  NF4GemvPlan p;
  p.kind = kind;
  if (m <= 0 || k <= 0 || n <= 0) return p;
  if (kind != NF4GemvKind::staged) {
    p.chunk = k;
    p.blocks = std::min((n + kNF4GemvBlockRows - 1) / kNF4GemvBlockRows, kNF4GemvMaxBlocks);
    return p;
  }
  const int64_t step_bytes =
      m * nf4_gemv_slot(kNF4GemvStep, elem_bytes) * elem_bytes;  // one step of every row
  const int64_t steps_fit = std::max<int64_t>(1, kNF4GemvSmemBytes / step_bytes);
  const int64_t steps_needed = (k + kNF4GemvStep - 1) / kNF4GemvStep;
  p.chunk = std::min(steps_fit, steps_needed) * kNF4GemvStep;
  p.smem_bytes = m * nf4_gemv_slot(p.chunk, elem_bytes) * elem_bytes;
  p.blocks = std::min((n + kNF4GemvBlockRows - 1) / kNF4GemvBlockRows, kNF4GemvMaxBlocks);
  return p;
}

}  // namespace quanta::quant::quant_cuda
