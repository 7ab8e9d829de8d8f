// The CUDA quantizer kernels' host-side plans (quant/cuda/plans.h): tile
// sizes within their budgets, covering the work, on the CPU.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "quant/cuda/plans.h"
#include "quant/kernels/code_stats_pieces.h"
#include "quant/kernels/functors.h"

using namespace quanta;
using namespace quanta::quant;

TEST_CASE("quant cuda plans: tiles stay within their budgets and cover the work") {
  using namespace quant_cuda;
  CHECK(nearest_tiles(0, 5).rows == 0);
  CHECK(nearest_tiles(5, 0).codes == 0);
  const NearestTiles small = nearest_tiles(100, 50, 1000);
  CHECK(small.codes == 50);
  CHECK(small.rows == 20);
  const NearestTiles big = nearest_tiles(10, 5000, 1000);
  CHECK(big.codes == 1000);
  CHECK(big.rows == 1);
  const NearestTiles wide = nearest_tiles(8192, 16384);
  CHECK(wide.codes == kNearestMaxCodes);
  CHECK(wide.rows * wide.codes <= kNearestTileElems);
  CHECK(nearest_tiles(3, 10).rows == 3);
  // The bench's searches: 1024 codes in two tiles of 16 MiB (f32), each read
  // back from L2; 16384 codes keep tiles of 4096 rows (a warp each).
  const NearestTiles bench = nearest_tiles(8192, 1024);
  CHECK(bench.codes == 1024);
  CHECK(bench.rows == 4096);
  CHECK(bench.rows * bench.codes == kNearestL2TileElems);
  CHECK(wide.rows == kNearestMinTileRows);
  CHECK(nearest_tiles(8192, 256).rows == 8192);  // 8 MiB: one tile

  CHECK(nf4_tile_rows(0, 64) == 0);
  CHECK(nf4_tile_rows(10, 0) == 0);
  CHECK(nf4_tile_rows(10, 64, 256) == 4);
  CHECK(nf4_tile_rows(10, 1000, 256) == 1);
  CHECK(nf4_tile_rows(3, 64) == 3);
  CHECK(nf4_tile_rows(100000, 4096) * 4096 <= kNF4GpuTileElems);

  CHECK(squared_error_chunks(0) == 0);
  CHECK(squared_error_chunks(1) == 1);
  CHECK(squared_error_chunks(256) == 1);
  CHECK(squared_error_chunks(257) == 2);
}

TEST_CASE("quant cuda plans: the NF4 GEMV takes small batches of whole runs, in its budget") {
  using namespace quant_cuda;
  alignas(8) static uint8_t bytes[4 * kNF4UnitBytes];
  const NF4Runs units = nf4_unit_runs(bytes, 4 * 64);
  CHECK(nf4_use_gemv(1, 128, 2, units));
  CHECK(nf4_use_gemv(kNF4GemvMaxBatch, 64, 3, units));
  CHECK_FALSE(nf4_use_gemv(kNF4GemvMaxBatch + 1, 64, 3, units));  // the tiled path
  CHECK_FALSE(nf4_use_gemv(0, 64, 3, units));
  CHECK_FALSE(nf4_use_gemv(1, 0, 3, units));
  CHECK_FALSE(nf4_use_gemv(1, 96, 2, units));  // rows would start inside a run
  CHECK_FALSE(nf4_use_gemv(1, 64, 2, nf4_unit_runs(bytes + 2, 128)));  // unaligned words
  const float scales[8] = {};
  CHECK(nf4_use_gemv(2, 96, 2, nf4_packed_runs(bytes, scales, 192, 32)));  // block 32: runs of 32
  CHECK(nf4_use_gemv(2, 128, 2, nf4_packed_runs(bytes, scales, 256, 128)));
  CHECK_FALSE(nf4_use_gemv(2, 96, 2, nf4_packed_runs(bytes, scales, 192, 64)));

  CHECK(nf4_gemv_plan(0, 64, 8, 4).blocks == 0);
  CHECK(nf4_gemv_plan(1, 64, 0, 4).blocks == 0);
  for (int64_t e : {4, 8}) {
    // Every lane's 8 staged values start on 16 bytes, and the 8 lanes of one
    // 16-byte load phase start in 8 different bank groups.
    std::vector<int> seen(8, 0);
    for (int64_t lane = 0; lane < 8; ++lane) {
      const int64_t at = nf4_gemv_slot(8 * lane, e) * e;
      CHECK(at % 16 == 0);
      ++seen[static_cast<size_t>(at / 16 % 8)];
    }
    CHECK(std::count(seen.begin(), seen.end(), 1) == 8);
    for (int64_t m = 1; m <= kNF4GemvMaxBatch; ++m)
      for (int64_t k : {64, 256, 320, 4096, 8192, 65536})
        for (int64_t n : {int64_t{1}, int64_t{16}, int64_t{17}, int64_t{8192}, int64_t{1} << 22}) {
          CAPTURE(e);
          CAPTURE(m);
          CAPTURE(k);
          CAPTURE(n);
          const NF4GemvPlan p = nf4_gemv_plan(m, k, n, e);
          CHECK(p.chunk % kNF4GemvStep == 0);
          CHECK(p.chunk >= kNF4GemvStep);
          CHECK(p.chunk < k + kNF4GemvStep);  // never more than one partial step past k
          CHECK(p.smem_bytes == m * nf4_gemv_slot(p.chunk, e) * e);
          CHECK(p.smem_bytes <= kNF4GemvSmemBytes);
          CHECK(p.blocks >= 1);
          CHECK(p.blocks <= kNF4GemvMaxBlocks);
          CHECK((p.blocks == kNF4GemvMaxBlocks || p.blocks * kNF4GemvBlockRows >= n));
        }
  }
  // One row of x of 8192 f32 values: two passes of at most 32 KiB.
  CHECK(nf4_gemv_plan(1, 8192, 8192, 4).chunk == 21 * kNF4GemvStep);
  CHECK(nf4_gemv_plan(1, 8192, 8192, 4).blocks == 8192 / kNF4GemvBlockRows);
}

TEST_CASE("quant cuda plans: bf16 products for f32 data, bf16 dequant, past the GEMV's rows") {
  using namespace quant_cuda;
  CHECK(nf4_bf16_products(true, DType::bf16, kNF4GemvMaxBatch + 1));
  CHECK(nf4_bf16_products(true, DType::bf16, 2048));
  CHECK_FALSE(nf4_bf16_products(true, DType::bf16, kNF4GemvMaxBatch));  // the GEMV's batch
  CHECK_FALSE(nf4_bf16_products(false, DType::bf16, 2048));             // f64 data
  CHECK_FALSE(nf4_bf16_products(true, DType::f32, 2048));
  CHECK_FALSE(nf4_bf16_products(true, DType::f16, 2048));
  // The CPU's threshold is the same (quant/cpu/nf4_linear_kernels.cpp).
  CHECK(kNF4GemvMaxBatch == kNF4FusedMaxBatch);
}

TEST_CASE("quant cuda plans: both NF4 GEMV kernels, chosen by name, cover every column once") {
  using namespace quant_cuda;
  // Unset: the kernel an H100 timed faster at one row; staged for more.
  CHECK(nf4_gemv_kind_from(nullptr, 1) == NF4GemvKind::unstaged);
  CHECK(nf4_gemv_kind_from("", 1) == NF4GemvKind::unstaged);
  CHECK(nf4_gemv_kind_from(nullptr, 2) == NF4GemvKind::staged);
  CHECK(nf4_gemv_kind_from("", 8) == NF4GemvKind::staged);
  for (const int64_t rows : {1, 2, 8}) {
    CHECK(nf4_gemv_kind_from("staged", rows) == NF4GemvKind::staged);
    CHECK(nf4_gemv_kind_from("unstaged", rows) == NF4GemvKind::unstaged);
  }
  for (const int64_t rows : {1, 2, 8})
    CHECK(nf4_gemv_kind_from("fixed", rows) == NF4GemvKind::fixed);
  CHECK_THROWS_WITH_AS(nf4_gemv_kind_from("wide", 1),
                       "QUANTA_NF4_GEMV must be staged, unstaged or fixed, got 'wide'",
                       std::invalid_argument);
  // Unstaged: one pass, nothing in shared memory; a block per
  // kNF4GemvBlockRows rows, as the staged plan.
  const NF4GemvPlan p = nf4_gemv_plan(3, 8192, 8193, 4, NF4GemvKind::unstaged);
  CHECK(p.kind == NF4GemvKind::unstaged);
  CHECK(p.smem_bytes == 0);
  CHECK(p.chunk == 8192);
  CHECK(p.blocks == (8193 + kNF4GemvBlockRows - 1) / kNF4GemvBlockRows);
  CHECK(nf4_gemv_plan(1, 64, 0, 4, NF4GemvKind::unstaged).blocks == 0);
  CHECK(nf4_gemv_plan(1, 64, 1u << 30, 8, NF4GemvKind::unstaged).blocks == kNF4GemvMaxBlocks);
  // The kernels' walk: passes of `chunk` columns from c0; in a pass of len
  // columns, lane l loads the words at k = k0 + s 256 (s below
  // kNF4GemvStepsInFlight, k below len) for k0 = 8 l, 8 l + 1024, ...
  // For k whole runs of 32 or 64 the words cover [0, k) once each, and each
  // lies in one run (one scale).
  for (NF4GemvKind kind : {NF4GemvKind::staged, NF4GemvKind::unstaged})
    for (int64_t run : {int64_t{32}, int64_t{64}})
      for (int64_t k :
           {run, 3 * run, int64_t{1024}, int64_t{1056}, int64_t{8192} + run, 20 * 1024 + run}) {
        CAPTURE(run);
        CAPTURE(k);
        CAPTURE(static_cast<int>(kind));
        const int64_t chunk = nf4_gemv_plan(1, k, 16, 4, kind).chunk;
        std::vector<int> hits(static_cast<size_t>(k), 0);
        bool in_one_run = true;
        for (int64_t c0 = 0; c0 < k; c0 += chunk) {
          const int64_t len = std::min(chunk, k - c0);
          for (int64_t lane = 0; lane < kWarp; ++lane)
            for (int64_t k0 = kNF4GemvCodesPerLane * lane; k0 < len;
                 k0 += kNF4GemvStepsInFlight * kNF4GemvStep)
              for (int s = 0; s < kNF4GemvStepsInFlight && k0 + s * kNF4GemvStep < len; ++s) {
                const int64_t col = c0 + k0 + s * kNF4GemvStep;
                in_one_run = in_one_run && col / run == (col + kNF4GemvCodesPerLane - 1) / run &&
                             col + kNF4GemvCodesPerLane <= k;
                for (int64_t c = col; c < std::min(k, col + kNF4GemvCodesPerLane); ++c)
                  ++hits[static_cast<size_t>(c)];
              }
        }
        CHECK(in_one_run);
        CHECK(std::count(hits.begin(), hits.end(), 1) == k);
      }
}

TEST_CASE("quant cuda plans: the GEMV's cursors step onto each word's codes and scale") {
  using namespace quant_cuda;
  // Every layout the GEMV takes: nf4 dtype units (run 64, codes and scale in
  // 36 bytes), bitsandbytes' packed codes with blocks of 32 and 64 (a scale
  // a run) and of 128, 192 and 4096 (a scale for several runs, blocks
  // straddling rows where the row is not whole blocks). The cursor, stepped
  // along a lane's columns, must point where the run's own index does.
  std::vector<uint8_t> codes(1 << 20);
  std::vector<float> scales(1 << 16);
  struct Layout {
    NF4Runs w;
    int64_t k;
  };
  std::vector<Layout> layouts;
  for (int64_t k : {256, 320, 1024, 1088}) {
    const int64_t n = 5 * k;
    layouts.push_back({nf4_unit_runs(codes.data(), n), k});
    for (int64_t block : {32, 64, 128, 192, 4096})
      layouts.push_back({nf4_packed_runs(codes.data(), scales.data(), n, block), k});
  }
  for (const Layout& l : layouts) {
    const NF4Runs& w = l.w;
    CAPTURE(w.run);
    CAPTURE(w.runs_per_scale);
    CAPTURE(l.k);
    const int64_t runs_per_row = l.k / w.run, rows = w.n / l.k;
    const NF4GemvSteps steps = nf4_gemv_steps(w, w.run);
    bool all_match = true;
    int64_t visited = 0;
    for (int64_t row = 0; row < rows; ++row)
      for (int64_t lane = 0; lane < kWarp; ++lane)
        for (int64_t c0 : {int64_t{0}, kNF4GemvStep}) {  // a pass's start, as the staged kernel's
          const int64_t first = c0 + kNF4GemvCodesPerLane * lane;
          NF4GemvCursor at = nf4_gemv_cursor(w, w.run, row, runs_per_row, first);
          for (int64_t col = first; col < l.k; col += kNF4GemvStep) {
            const int64_t run = row * runs_per_row + col / w.run;
            all_match = all_match &&
                        at.codes == quant::fn::nf4_run_codes(w, run) + col % w.run / 2 &&
                        at.scale == quant::fn::nf4_run_scale_bytes(w, run);
            ++visited;
            nf4_gemv_advance(at, steps);
          }
        }
    CHECK(all_match);
    CHECK(visited > rows * l.k / kNF4GemvStep);
  }
}

TEST_CASE("quant cuda plans: the fixed GEMV's constant steps land where the cursors do") {
  using namespace quant_cuda;
  std::vector<uint8_t> codes(1 << 20);
  std::vector<float> scales(1 << 16);
  const int64_t k = 1088, n = 5 * k;  // rows of 4.25 steps: whole groups, then single steps
  struct Layout {
    NF4Runs w;
    NF4GemvWalk walk;
  };
  // Blocks of 192 and 4096: a scale for a run and a half, or 16 steps; none.
  const Layout layouts[] = {
      {nf4_unit_runs(codes.data(), n), NF4GemvWalk::units},
      {nf4_packed_runs(codes.data(), scales.data(), n, 32), NF4GemvWalk::packed32},
      {nf4_packed_runs(codes.data(), scales.data(), n, 64), NF4GemvWalk::packed64},
      {nf4_packed_runs(codes.data(), scales.data(), n, 128), NF4GemvWalk::packed128},
      {nf4_packed_runs(codes.data(), scales.data(), n, 256), NF4GemvWalk::packed256},
      {nf4_packed_runs(codes.data(), scales.data(), n, 192), NF4GemvWalk::none},
      {nf4_packed_runs(codes.data(), scales.data(), n, 4096), NF4GemvWalk::none}};
  for (const Layout& l : layouts) {
    const NF4Runs& w = l.w;
    CAPTURE(w.run);
    CAPTURE(w.runs_per_scale);
    CHECK(nf4_gemv_walk(w) == l.walk);
    const NF4GemvSteps steps = nf4_gemv_steps(w, w.run);
    if (l.walk == NF4GemvWalk::none) {
      // A carry between runs: the scale's step is not one constant.
      CHECK((steps.scale_rem != 0 || steps.scale_bytes == 0));
      continue;
    }
    const NF4GemvFixedSteps fixed = nf4_gemv_fixed_steps(l.walk);
    CHECK(fixed.code_bytes == steps.code_bytes);
    CHECK(fixed.scale_bytes == steps.scale_bytes);
    CHECK(steps.scale_rem == 0);
    // The kernel's addresses: each lane's cursor at its first column, plus
    // s constant steps; against the run's own index at every column.
    bool all_match = true;
    for (int64_t row = 0; row < n / k; ++row)
      for (int64_t lane = 0; lane < kWarp; ++lane) {
        const int64_t first = kNF4GemvCodesPerLane * lane;
        const NF4GemvCursor at = nf4_gemv_cursor(w, w.run, row, k / w.run, first);
        int64_t s = 0;
        for (int64_t col = first; col < k; col += kNF4GemvStep, ++s) {
          const int64_t run = row * (k / w.run) + col / w.run;
          all_match = all_match &&
                      at.codes + s * fixed.code_bytes ==
                          quant::fn::nf4_run_codes(w, run) + col % w.run / 2 &&
                      at.scale + s * fixed.scale_bytes == quant::fn::nf4_run_scale_bytes(w, run);
        }
      }
    CHECK(all_match);
  }
  // Not the nf4 dtype's units: scales elsewhere than after their codes.
  NF4Runs moved = nf4_unit_runs(codes.data(), n);
  moved.scales = codes.data() + 4;
  CHECK(nf4_gemv_walk(moved) == NF4GemvWalk::none);
}

TEST_CASE("quant cuda plans: the fixed GEMV runs for one f32 row of a fixed walk, else unstaged") {
  using namespace quant_cuda;
  const NF4GemvKind fixed = NF4GemvKind::fixed, unstaged = NF4GemvKind::unstaged,
                    staged = NF4GemvKind::staged;
  CHECK(nf4_gemv_kind_for(fixed, 1, 4, NF4GemvWalk::units, true) == fixed);
  CHECK(nf4_gemv_kind_for(fixed, 1, 4, NF4GemvWalk::packed256, true) == fixed);
  CHECK(nf4_gemv_kind_for(fixed, 2, 4, NF4GemvWalk::units, true) == unstaged);  // two rows
  CHECK(nf4_gemv_kind_for(fixed, 1, 8, NF4GemvWalk::units, true) == unstaged);  // f64
  CHECK(nf4_gemv_kind_for(fixed, 1, 4, NF4GemvWalk::none, true) == unstaged);
  // x off 16 bytes: the staged kernel, whatever was asked.
  CHECK(nf4_gemv_kind_for(fixed, 1, 4, NF4GemvWalk::units, false) == staged);
  CHECK(nf4_gemv_kind_for(unstaged, 1, 4, NF4GemvWalk::units, false) == staged);
  CHECK(nf4_gemv_kind_for(unstaged, 1, 4, NF4GemvWalk::units, true) == unstaged);
  CHECK(nf4_gemv_kind_for(staged, 3, 8, NF4GemvWalk::none, true) == staged);
  // Its plan: the unstaged kernel's (one pass, a block per kNF4GemvBlockRows rows).
  const NF4GemvPlan p = nf4_gemv_plan(1, 8192, 8193, 4, fixed);
  CHECK(p.kind == fixed);
  CHECK(p.smem_bytes == 0);
  CHECK(p.chunk == 8192);
  CHECK(p.blocks == (8193 + kNF4GemvBlockRows - 1) / kNF4GemvBlockRows);
}

TEST_CASE("quant cuda plans: nf4_decode takes whole aligned words, the rest element by element") {
  using namespace quant_cuda;
  alignas(16) static uint8_t bytes[8 * kNF4UnitBytes];
  alignas(16) static float out[8];
  const float scales[8] = {};
  const NF4Runs units = nf4_unit_runs(bytes, 8 * 64);
  const auto check = [](const NF4DecodeSplit& s, int64_t words, int64_t tail_begin,
                        int64_t tail_count) {
    CHECK(s.words == words);
    CHECK(s.tail_begin == tail_begin);
    CHECK(s.tail_count == tail_count);
  };
  check(nf4_decode_split(units, 0, 512, out), 64, 512, 0);
  check(nf4_decode_split(units, 64, 203, out), 25, 264, 3);  // a partial last word
  check(nf4_decode_split(units, 0, 5, out), 0, 0, 5);        // less than a word
  check(nf4_decode_split(units, 4, 100, out), 0, 4, 100);    // begin inside a word
  check(nf4_decode_split(units, 0, 64, out + 1), 0, 0, 64);  // output not on 16 bytes
  check(nf4_decode_split(nf4_unit_runs(bytes + 2, 128), 0, 128, out), 0, 0, 128);  // codes
  check(nf4_decode_split(nf4_packed_runs(bytes, scales, 96, 32), 0, 96, out), 12, 96, 0);
  check(nf4_decode_split(units, 0, 0, out), 0, 0, 0);
  CHECK(nf4_word_aligned(units));
  CHECK_FALSE(nf4_word_aligned(nf4_packed_runs(bytes + 1, scales, 96, 32)));
  // A word never straddles two runs, so one scale serves its 8 codes.
  static_assert(32 % kNF4WordCodes == 0 && 64 % kNF4WordCodes == 0);
}

// Every code of every word decoded once, by a thread whose 16-byte store
// lands where those codes' elements go; a warp's stores contiguous.
template <int64_t E>
void check_decode_pieces() {
  INFO("output elements of ", E, " bytes");
  const int64_t words = 37, codes = quant_cuda::nf4_decode_thread_codes(E);
  const int64_t threads = quant_cuda::nf4_decode_threads(words, E);
  CHECK(threads * codes == words * quant_cuda::kNF4WordCodes);
  std::vector<int> hits(static_cast<size_t>(words * quant_cuda::kNF4WordCodes), 0);
  for (int64_t t = 0; t < threads; ++t) {
    const quant_cuda::NF4DecodePiece p = quant_cuda::nf4_decode_piece<E>(t);
    REQUIRE(p.word < words);
    REQUIRE(p.first_code + codes <= quant_cuda::kNF4WordCodes);
    const int64_t element = p.word * quant_cuda::kNF4WordCodes + p.first_code;
    CHECK(element == t * codes);  // the store at element t * codes: 16 t bytes
    for (int64_t j = 0; j < codes; ++j) ++hits[static_cast<size_t>(element + j)];
  }
  CHECK(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }));
}

TEST_CASE("quant cuda plans: nf4_decode's threads store 16 contiguous bytes each") {
  check_decode_pieces<2>();
  check_decode_pieces<4>();
  check_decode_pieces<8>();
  static_assert(quant_cuda::nf4_decode_thread_codes(4) == 4);
  static_assert(quant_cuda::nf4_decode_piece<4>(5).word == 2 &&
                quant_cuda::nf4_decode_piece<4>(5).first_code == 4);
  static_assert(quant_cuda::nf4_decode_piece<2>(5).word == 5 &&
                quant_cuda::nf4_decode_piece<2>(5).first_code == 0);
}

TEST_CASE("quant cuda plans: code_statistics' pieces are about sqrt(n) rows, powers of two") {
  using namespace quant_cuda;
  CHECK(code_stats_piece_rows(0) == 32);
  CHECK(code_stats_piece_rows(1000) == 32);
  CHECK(code_stats_piece_rows(1025) == 64);
  CHECK(code_stats_piece_rows(65536) == 256);
  CHECK(code_stats_piece_rows(int64_t{1} << 30) == 1024);  // the cap: 8 KiB of staged keys
  for (int64_t n : {1, 33, 3136, 100000, 1 << 22}) {
    const int64_t p = code_stats_piece_rows(n);
    CHECK((p & (p - 1)) == 0);
    CHECK((p == 1024 || p * p >= n));
    CHECK((p == 32 || (p / 2) * (p / 2) < n));
  }
  CHECK(code_stats_threads(1) == 32);
  CHECK(code_stats_threads(64) == 64);
  CHECK(code_stats_threads(65) == 96);
  CHECK(code_stats_threads(4096) == 256);
}
