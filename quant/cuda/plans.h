#pragma once
// How the CUDA quantizer kernels split their work: tiles and chunk counts,
// computed on the host. Plain C++ so the CPU tests check them; the .cu files
// only follow them. Grid sizes come from engine/cuda/launch.h.
#include <algorithm>
#include <cstdint>

namespace quanta::quant::quant_cuda {

/** Rows per squared_error partial sum: the contract's 256-row chunks. */
inline constexpr int64_t kSquaredErrorChunk = 256;

/** Elements of scratch a nearest_codes score tile may take (64 MiB of f32). */
inline constexpr int64_t kNearestTileElems = int64_t{1} << 24;

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
 * them. Zero tiles when there is nothing to search. */
inline NearestTiles nearest_tiles(int64_t n, int64_t k, int64_t budget = kNearestTileElems) {
  NearestTiles t;
  if (n <= 0 || k <= 0) return t;
  budget = std::max<int64_t>(budget, 1);
  t.codes = std::min({k, budget, kNearestMaxCodes});
  t.rows = std::max<int64_t>(1, std::min(n, budget / t.codes));
  return t;
}

/** Weight rows per dequantized nf4_linear tile of `k` columns within
 * `budget` elements (at least 1, at most n_rows; 0 when there is nothing). */
inline int64_t nf4_tile_rows(int64_t n_rows, int64_t k, int64_t budget = kNF4GpuTileElems) {
  if (n_rows <= 0 || k <= 0) return 0;
  return std::max<int64_t>(1, std::min(n_rows, budget / k));
}

}  // namespace quanta::quant::quant_cuda
