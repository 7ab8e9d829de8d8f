// CPU entries nf4_linear and nf4_linear_grad (quant/kernels/table.h): a
// linear layer's product with a frozen NF4 weight. A batch of at most 8 rows
// whose rows start on a run of codes is decoded on the fly while the packed
// bytes are read once. Batches under kNF4SlabMinBatch rows, whose products
// are bound by reading the decoded weight, decode it tile by tile into
// small per-thread buffers (a thread per tile forward, a thread per row
// block backward). Larger batches decode it slab by slab (kNF4SlabElems
// elements, in parallel) and multiply each slab by one threaded product, so
// the decoding is done once whatever the thread count and the product takes
// every thread whatever the layer's size. With bf16
// compute the activation is rounded to bf16 as bitsandbytes rounds it: on a
// CPU whose bf16 products pay, the operands and slabs are bf16; elsewhere
// the bf16 values stay in f32 for f32 products.
#include <algorithm>
#include <array>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "engine/cpu/block_cache.h"
#include "engine/cpu/gemm.h"
#include "engine/cpu/gemm_bf16.h"
#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"
#include "quant/cpu/kernels.h"
#include "quant/cpu/nf4_simd.h"

namespace quanta::quant::quant_cpu {
namespace {

// Below this many rows per thread, backward runs one row block (the tiles'
// products are then threaded instead).
constexpr int64_t kBackwardRowGrain = 64;

// Rows per tile: about kNF4TileElems elements, a multiple of the rows after
// which a row starts a run again, so each tile starts on a run.
int64_t tile_rows(int64_t n_rows, int64_t k, int64_t run) {
  int64_t align = 1;
  while ((align * k) % run != 0) ++align;
  int64_t rows = std::max<int64_t>(1, kNF4TileElems / std::max<int64_t>(k, 1));
  rows = std::max(align, rows / align * align);
  return std::min(rows, n_rows);
}

#if defined(__AVX512F__)
// y[m, n] for MB rows of x: per run of R codes, the 16 dequantized values
// (rounded to dd) in a register, one lookup per 16 codes, FMAs into x.
template <int MB, int R>
void fused_rows_f32(const float* x, int64_t K, const NF4Runs& w, DType dd, int64_t N, float* y,
                    int64_t lo, int64_t hi) {
  const int64_t runs_per_row = K / R;
  for (int64_t n = lo; n < hi; ++n) {
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t u = 0; u < runs_per_row; ++u) {
      const int64_t r = n * runs_per_row + u;
      const uint8_t* codes = w.codes_of(r);
      const __m512 lut = simd::scaled_values(w.scale_of(r), dd);
      const int64_t k0 = u * R;
      for (int g = 0; g < R / 16; ++g) {
        uint64_t eight;
        std::memcpy(&eight, codes + 8 * g, 8);
        const __m512 wv = simd::decode16(eight, lut);
        for (int m = 0; m < MB; ++m)
          acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k0 + 16 * g), acc[m]);
      }
    }
    for (int m = 0; m < MB; ++m) y[m * N + n] = _mm512_reduce_add_ps(acc[m]);
  }
}
#define QUANTA_NF4_FUSED_SIMD 1
#elif defined(__AVX2__)
template <int MB, int R>
void fused_rows_f32(const float* x, int64_t K, const NF4Runs& w, DType dd, int64_t N, float* y,
                    int64_t lo, int64_t hi) {
  const int64_t runs_per_row = K / R;
  for (int64_t n = lo; n < hi; ++n) {
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t u = 0; u < runs_per_row; ++u) {
      const int64_t r = n * runs_per_row + u;
      const uint8_t* codes = w.codes_of(r);
      const std::array<float, 16> t = simd::scaled_table(w.scale_of(r), dd);
      const __m256 lo_vals = _mm256_loadu_ps(t.data());
      const __m256 hi_vals = _mm256_loadu_ps(t.data() + 8);
      const int64_t k0 = u * R;
      for (int g = 0; g < R / 8; ++g) {
        uint32_t four;
        std::memcpy(&four, codes + 4 * g, 4);
        const __m256 wv = simd::decode8(four, lo_vals, hi_vals);
        for (int m = 0; m < MB; ++m)
          acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k0 + 8 * g), acc[m]);
      }
    }
    for (int m = 0; m < MB; ++m) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[m]);
      float t = 0;
      for (float l : lanes) t += l;
      y[m * N + n] = t;
    }
  }
}
#define QUANTA_NF4_FUSED_SIMD 1
#endif

// Portable form: the dequantized values dd(code * scale) times x, for
// M <= 8 rows.
template <class T, int R>
void fused_rows_scalar(const T* x, int64_t M, int64_t K, const NF4Runs& w, DType dd, int64_t N,
                       T* y, int64_t lo, int64_t hi) {
  const int64_t runs_per_row = K / R;
  for (int64_t n = lo; n < hi; ++n) {
    T acc[kNF4FusedMaxBatch] = {};
    for (int64_t u = 0; u < runs_per_row; ++u) {
      const int64_t r = n * runs_per_row + u;
      const uint8_t* codes = w.codes_of(r);
      const std::array<float, 16> t = simd::scaled_table(w.scale_of(r), dd);
      T lut[16];
      for (int c = 0; c < 16; ++c) lut[c] = static_cast<T>(t[c]);
      const int64_t k0 = u * R;
      for (int64_t m = 0; m < M; ++m) {
        const T* xr = x + m * K + k0;
        T a = 0;
        for (int j = 0; j < R / 2; ++j)
          a += xr[2 * j] * lut[codes[j] >> 4] + xr[2 * j + 1] * lut[codes[j] & 15];
        acc[m] += a;
      }
    }
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = acc[m];
  }
}

// y[m, n] = sum_k x[m, k] W[n, k] for M <= 8 rows, reading each packed weight
// byte once (rows of W in parallel); needs K % R == 0 so rows are whole runs.
template <class T, int R>
void fused_small_batch(const T* x, int64_t M, int64_t K, const NF4Runs& w, DType dd, int64_t N,
                       T* y) {
  const int64_t grain = std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(K, 1));
  cpu::parallel_for(0, N, grain, [&](int64_t lo, int64_t hi) {
#ifdef QUANTA_NF4_FUSED_SIMD
    if constexpr (std::is_same_v<T, float>) {
      switch (M) {
        case 1:
          return fused_rows_f32<1, R>(x, K, w, dd, N, y, lo, hi);
        case 2:
          return fused_rows_f32<2, R>(x, K, w, dd, N, y, lo, hi);
        case 3:
          return fused_rows_f32<3, R>(x, K, w, dd, N, y, lo, hi);
        case 4:
          return fused_rows_f32<4, R>(x, K, w, dd, N, y, lo, hi);
        case 5:
          return fused_rows_f32<5, R>(x, K, w, dd, N, y, lo, hi);
        case 6:
          return fused_rows_f32<6, R>(x, K, w, dd, N, y, lo, hi);
        case 7:
          return fused_rows_f32<7, R>(x, K, w, dd, N, y, lo, hi);
        default:
          return fused_rows_f32<8, R>(x, K, w, dd, N, y, lo, hi);
      }
    }
#endif
    fused_rows_scalar<T, R>(x, M, K, w, dd, N, y, lo, hi);
  });
}

// bf16 compute as bitsandbytes' bnb_4bit_compute_dtype=bfloat16 runs it:
// the activation (x forward, g backward) rounded to bf16 once, the weight
// decoded to bf16, products through the CPU's bf16 instructions, f32 sums.
// The result stays f32 (bitsandbytes rounds it to bf16 before casting back).
bool bf16_compute(DType dd, int64_t M) { return dd == DType::bf16 && M > kNF4FusedMaxBatch; }

bool use_bf16_products(DType dd, int64_t M) {
  return bf16_compute(dd, M) && cpu::bf16_gemm_native();
}

// bf16 compute where f32 products are the faster ones: the activation's
// bf16 values (rows x cols) in f32, so the f32 products below multiply what
// the bf16 products would, with the same f32 sums in another order.
const float* bf16_valued(const float* a, int64_t rows, int64_t cols,
                         const cpu::ScratchBuffer& out) {
  float* dst = out.as<float>();
  const int64_t grain = std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(cols, 1));
  cpu::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
    cpu::round_to_bf16_values(a + lo * cols, (hi - lo) * cols, dst + lo * cols);
  });
  return dst;
}

// Rows [n0, n0 + r) of W, K each, decoded (rounded to dd, stored as E) into
// slab, in parallel.
template <class E>
void decode_slab(const NF4Runs& w, int64_t n0, int64_t r, int64_t K, DType dd, E* slab) {
  const int64_t grain = std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(K, 1));
  cpu::parallel_for(0, r, grain, [&](int64_t lo, int64_t hi) {
    nf4_decode_range(w, (n0 + lo) * K, (hi - lo) * K, dd, slab + lo * K);
  });
}

// Calls product(n0, r, slab) for each slab of rows [n0, n0 + r) of W,
// decoded (rounded to dd, stored as E; r x K, row-major) into one reused
// buffer of at most kNF4SlabElems elements.
template <class E, class Product>
void for_each_slab(const NF4Runs& w, int64_t N, int64_t K, DType dd, Product&& product) {
  const int64_t rows = std::clamp<int64_t>(kNF4SlabElems / std::max<int64_t>(K, 1), 1, N);
  const cpu::ScratchBuffer slab(sizeof(E) * size_t(rows * K));
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    const int64_t r = std::min(rows, N - n0);
    decode_slab(w, n0, r, K, dd, slab.as<E>());
    product(n0, r, static_cast<const E*>(slab.as<E>()));
  }
}

// x rounded (shared: already in `rounded`, when set) then multiplied.
void forward_bf16(const float* x, const bf16* rounded, int64_t M, int64_t K, const NF4Runs& w,
                  int64_t N, float* y) {
  const cpu::ScratchBuffer xs(rounded ? 0 : sizeof(bf16) * size_t(M * K));
  const bf16* xb = rounded ? rounded : cpu::round_operand_to_bf16(M, K, {x, K, 1}, xs.as<bf16>()).p;
  for_each_slab<bf16>(w, N, K, DType::bf16, [&](int64_t n0, int64_t r, const bf16* slab) {
    // slab^T as a [K, r] operand: element (k, n) at slab[n * K + k].
    cpu::gemm_bf16(M, r, K, {xb, K, 1}, {slab, 1, K}, y + n0, N);
  });
}

void backward_bf16(const float* g, int64_t M, int64_t N, const NF4Runs& w, int64_t K, float* dx,
                   bool accumulate) {
  const cpu::ScratchBuffer gs(sizeof(bf16) * size_t(M * N));
  const bf16* gb = cpu::round_operand_to_bf16(M, N, {g, N, 1}, gs.as<bf16>()).p;
  for_each_slab<bf16>(w, N, K, DType::bf16, [&](int64_t n0, int64_t r, const bf16* slab) {
    cpu::gemm_bf16(M, K, r, {gb + n0, N, 1}, {slab, K, 1}, dx, K, accumulate || n0 > 0);
  });
}

// y [M, N] = x [M, K] W^T.
template <class T>
void forward_kernel(const T* x, int64_t M, int64_t K, const NF4Runs& w, DType dd, int64_t N, T* y,
                    const bf16* rounded) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    std::fill(y, y + M * N, T(0));
    return;
  }
  const bool round_x = std::is_same_v<T, float> && bf16_compute(dd, M);
  const cpu::ScratchBuffer xs(round_x ? sizeof(float) * size_t(M * K) : 0);
  if constexpr (std::is_same_v<T, float>) {
    if (use_bf16_products(dd, M)) return forward_bf16(x, rounded, M, K, w, N, y);
    if (round_x) x = bf16_valued(x, M, K, xs);
  }
  if (M <= kNF4FusedMaxBatch && K % w.run == 0) {
    if (w.run == 32)
      fused_small_batch<T, 32>(x, M, K, w, dd, N, y);
    else
      fused_small_batch<T, 64>(x, M, K, w, dd, N, y);
    return;
  }
  if (M < kNF4SlabMinBatch) {
    // Threads take whole tiles, each decoded into a private buffer and
    // multiplied by a single-threaded product: one parallel region a call.
    const int64_t rows = tile_rows(N, K, w.run);
    const int64_t tiles = (N + rows - 1) / rows;
    cpu::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
      std::vector<T> tile(static_cast<size_t>(rows * K));
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t n0 = t * rows, r = std::min(rows, N - n0);
        nf4_decode_range(w, n0 * K, r * K, dd, tile.data());
        // tile^T as a [K, r] operand: element (k, n) at tile[n * K + k].
        cpu::gemm<T>(M, r, K, {x, K, 1}, {tile.data(), 1, K}, y + n0, N);
      }
    });
    return;
  }
  for_each_slab<T>(w, N, K, dd, [&](int64_t n0, int64_t r, const T* slab) {
    // slab^T as a [K, r] operand: element (k, n) at slab[n * K + k].
    cpu::gemm<T>(M, r, K, {x, K, 1}, {slab, 1, K}, y + n0, N);
  });
}

// dx [M, K] = (or +=) g [M, N] W, summed slab by slab.
template <class T>
void backward_kernel(const T* g, int64_t M, int64_t N, const NF4Runs& w, DType dd, int64_t K, T* dx,
                     bool accumulate) {
  if (M == 0 || K == 0) return;
  if (N == 0) {
    if (!accumulate) std::fill(dx, dx + M * K, T(0));
    return;
  }
  const bool round_g = std::is_same_v<T, float> && bf16_compute(dd, M);
  const cpu::ScratchBuffer gs(round_g ? sizeof(float) * size_t(M * N) : 0);
  if constexpr (std::is_same_v<T, float>) {
    if (use_bf16_products(dd, M)) return backward_bf16(g, M, N, w, K, dx, accumulate);
    if (round_g) g = bf16_valued(g, M, N, gs);
  }
  if (M < kNF4SlabMinBatch) {
    // Threads take row blocks of dx (so no two write the same output) and
    // each walks all weight tiles.
    const int64_t rows = tile_rows(N, K, w.run);
    cpu::parallel_for(0, M, kBackwardRowGrain, [&](int64_t m0, int64_t m1) {
      std::vector<T> tile(static_cast<size_t>(rows * K));
      for (int64_t n0 = 0; n0 < N; n0 += rows) {
        const int64_t r = std::min(rows, N - n0);
        nf4_decode_range(w, n0 * K, r * K, dd, tile.data());
        cpu::gemm<T>(m1 - m0, K, r, {g + m0 * N + n0, N, 1}, {tile.data(), K, 1}, dx + m0 * K, K,
                     accumulate || n0 > 0);
      }
    });
    return;
  }
  for_each_slab<T>(w, N, K, dd, [&](int64_t n0, int64_t r, const T* slab) {
    cpu::gemm<T>(M, K, r, {g + n0, N, 1}, {slab, K, 1}, dx, K, accumulate || n0 > 0);
  });
}

}  // namespace

void nf4_linear(DType dtype, const void* x, int64_t M, int64_t K, const NF4Runs& w, DType dd,
                int64_t N, const void* bias, void* y, Bf16Input xb) {
  if (xb.data && dtype != DType::f32)
    throw std::logic_error("[nf4_linear] a shared bf16 input needs an f32 x");
  auto* rounded = static_cast<bf16*>(xb.data);
  if (xb.write) cpu::round_operand_to_bf16(M, K, {static_cast<const float*>(x), K, 1}, rounded);
  dispatch_float(dtype, "nf4_linear", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* py = static_cast<T*>(y);
    forward_kernel(static_cast<const T*>(x), M, K, w, dd, N, py, rounded);
    if (bias && M > 0) {
      const T* pb = static_cast<const T*>(bias);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) py[m * N + n] += pb[n];
    }
  });
}

void nf4_linear_grad(DType dtype, const void* g, int64_t M, int64_t N, const NF4Runs& w, DType dd,
                     int64_t K, void* dx, bool accumulate) {
  dispatch_float(dtype, "nf4_linear backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    backward_kernel(static_cast<const T*>(g), M, N, w, dd, K, static_cast<T*>(dx), accumulate);
  });
}

}  // namespace quanta::quant::quant_cpu
