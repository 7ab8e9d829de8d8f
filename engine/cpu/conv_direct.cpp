// Direct convolution kernels on AVX-512: see conv_direct.h. A tile is
// kRows output pixels (or kRows taps-and-channels for the weight gradient)
// by one or two vectors of 16 channels; its accumulators stay in registers
// for the whole sum and are written once.
#include "engine/cpu/conv_direct.h"

#include <atomic>
#include <stdexcept>

#if defined(__x86_64__) && defined(__GNUC__)
#define QUANTA_CONV_DIRECT 1
#include <immintrin.h>
#endif

namespace quanta::cpu {
namespace {

std::atomic<bool> g_enabled{true};

}  // namespace

void conv_direct_enable(bool on) { g_enabled.store(on, std::memory_order_relaxed); }

#if QUANTA_CONV_DIRECT

bool conv_direct_serves(ConvKind kind, const ConvGeom& g) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (!avx512 || !g_enabled.load(std::memory_order_relaxed) || g.groups != 1) return false;
  switch (kind) {
    case ConvKind::forward:
      return g.O % 16 == 0;
    case ConvKind::input_grad:
      return g.C % 16 == 0;
    default:
      return g.O % 16 == 0 && g.C % 8 == 0;
  }
}

// Everything below is compiled for AVX-512F whatever the build's -march, and
// runs only after conv_direct_serves checked the CPU. It calls nothing but
// intrinsics: an inline library function instantiated here would carry
// AVX-512 code into the rest of the program.
#pragma GCC push_options
#pragma GCC target("avx512f,fma")

namespace {

constexpr int kRows = 8;

// acc[r] += sum over i < count of row[r][i] * w[i * ld .. + 16 VB]: the
// tiles' inner loop (2 vector loads, 8 broadcasts, 16 FMAs at VB = 2), over
// channels in the forward and over outputs in the input gradient.
template <int VB>
inline __attribute__((always_inline)) void multiply_add(__m512 (&acc)[kRows][VB],
                                                        const float* const* row, const float* w,
                                                        int64_t ld, int64_t count) {
  for (int64_t i = 0; i < count; ++i, w += ld) {
    __m512 wv[VB];
    for (int v = 0; v < VB; ++v) wv[v] = _mm512_loadu_ps(w + 16 * v);
    for (int r = 0; r < kRows; ++r) {
      const __m512 b = _mm512_set1_ps(row[r][i]);
      for (int v = 0; v < VB; ++v) acc[r][v] = _mm512_fmadd_ps(b, wv[v], acc[r][v]);
    }
  }
}

// y rows [rows, O] (columns o0 .. o0 + 16 VB) of the tile whose pixel r lies
// in the image at base[r] and reads its taps from tap_row[r]; rows past
// `rows` repeat pixel 0 and are not stored.
template <int VB>
void forward_tile(const float* const* base, const int32_t* const* tap_row, int rows, int64_t kk,
                  int64_t C, int64_t O, int64_t o0, const float* wt, const float* zeros, float* y) {
  __m512 acc[kRows][VB];
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < VB; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t t = 0; t < kk; ++t) {
    const float* xr[kRows];
    for (int r = 0; r < kRows; ++r) {
      const int32_t p = tap_row[r][t];
      xr[r] = p < 0 ? zeros : base[r] + p * C;
    }
    multiply_add(acc, xr, wt + t * C * O + o0, O, C);
  }
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v < VB; ++v) _mm512_storeu_ps(y + r * O + o0 + 16 * v, acc[r][v]);
}

// gx += the tile's share: for each tap, acc [rows, 16 VB] = gy rows . wi[t]
// (a sum over O), added into the input pixels the tap reads.
template <int VB>
void input_grad_tile(const float* const* gy_row, float* const* base, const int32_t* const* tap_row,
                     int rows, int64_t kk, int64_t C, int64_t O, int64_t c0, const float* wi) {
  for (int64_t t = 0; t < kk; ++t) {
    __m512 acc[kRows][VB];
    for (int r = 0; r < kRows; ++r)
      for (int v = 0; v < VB; ++v) acc[r][v] = _mm512_setzero_ps();
    multiply_add(acc, gy_row, wi + t * O * C + c0, C, O);
    for (int r = 0; r < rows; ++r) {
      const int32_t p = tap_row[r][t];
      if (p < 0) continue;
      float* dst = base[r] + p * C + c0;
      for (int v = 0; v < VB; ++v)
        _mm512_storeu_ps(dst + 16 * v, _mm512_add_ps(_mm512_loadu_ps(dst + 16 * v), acc[r][v]));
    }
  }
}

// gw rows k0 .. k0 + 8 (8 channels of one tap, in [kh kw C] order) x
// columns o0 .. o0 + 16 VB += sum over the chunk's pixels of x . gy: one
// pointer per pixel, 8 broadcasts against VB vectors of gy.
template <int VB>
void weight_grad_tile(const float* x, const float* gy, int64_t nb, int64_t L, int64_t HWC,
                      const int32_t* pixel, int64_t kk, int64_t C, int64_t O, int64_t k0,
                      int64_t o0, const float* zeros, float* gw) {
  __m512 acc[kRows][VB];
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < VB; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t t = k0 / C, c0 = k0 % C;
  const float* g = gy + o0;
  for (int64_t j = 0; j < nb; ++j) {
    const float* image = x + j * HWC;
    for (int64_t l = 0; l < L; ++l, g += O) {
      __m512 gv[VB];
      for (int v = 0; v < VB; ++v) gv[v] = _mm512_loadu_ps(g + 16 * v);
      const int32_t p = pixel[l * kk + t];
      const float* xq = p < 0 ? zeros : image + p * C + c0;
      for (int r = 0; r < kRows; ++r) {
        const __m512 b = _mm512_set1_ps(xq[r]);
        for (int v = 0; v < VB; ++v) acc[r][v] = _mm512_fmadd_ps(b, gv[v], acc[r][v]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < VB; ++v) {
      float* dst = gw + (k0 + r) * O + o0 + 16 * v;
      _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), acc[r][v]));
    }
}

// The tile of pixels q0 .. q0 + rows of a chunk: each pixel's image and the
// row of the tap table its position reads. Rows past `rows` repeat pixel q0.
struct PixelTile {
  int64_t image[kRows];
  const int32_t* tap_row[kRows];
  int rows;
};

PixelTile pixel_tile(int64_t q0, int64_t P, int64_t L, int64_t kk, const int32_t* pixel) {
  PixelTile tile;
  tile.rows = P - q0 < kRows ? static_cast<int>(P - q0) : kRows;
  for (int r = 0; r < kRows; ++r) {
    const int64_t q = q0 + (r < tile.rows ? r : 0);
    tile.image[r] = q / L;
    tile.tap_row[r] = pixel + (q % L) * kk;
  }
  return tile;
}

}  // namespace

void conv_direct_forward(const float* x, int64_t nb, const ConvGeom& g, TapTable taps,
                         const float* wt, const float* zeros, float* y) {
  const int64_t L = g.L(), HWC = g.H * g.W * g.C, kk = g.kh * g.kw, P = nb * L;
  for (int64_t q0 = 0; q0 < P; q0 += kRows) {
    const PixelTile tile = pixel_tile(q0, P, L, kk, taps.pixel);
    const float* base[kRows];
    for (int r = 0; r < kRows; ++r) base[r] = x + tile.image[r] * HWC;
    for (int64_t o0 = 0; o0 < g.O; o0 += 32) {
      if (g.O - o0 >= 32)
        forward_tile<2>(base, tile.tap_row, tile.rows, kk, g.C, g.O, o0, wt, zeros, y + q0 * g.O);
      else
        forward_tile<1>(base, tile.tap_row, tile.rows, kk, g.C, g.O, o0, wt, zeros, y + q0 * g.O);
    }
  }
}

void conv_direct_input_grad(const float* gy, int64_t nb, const ConvGeom& g, TapTable taps,
                            const float* wi, float* gx) {
  const int64_t L = g.L(), HWC = g.H * g.W * g.C, kk = g.kh * g.kw, P = nb * L;
  for (int64_t q0 = 0; q0 < P; q0 += kRows) {
    const PixelTile tile = pixel_tile(q0, P, L, kk, taps.pixel);
    float* base[kRows];
    const float* gy_row[kRows];
    for (int r = 0; r < kRows; ++r) {
      base[r] = gx + tile.image[r] * HWC;
      gy_row[r] = gy + (q0 + (r < tile.rows ? r : 0)) * g.O;
    }
    for (int64_t c0 = 0; c0 < g.C; c0 += 32) {
      if (g.C - c0 >= 32)
        input_grad_tile<2>(gy_row, base, tile.tap_row, tile.rows, kk, g.C, g.O, c0, wi);
      else
        input_grad_tile<1>(gy_row, base, tile.tap_row, tile.rows, kk, g.C, g.O, c0, wi);
    }
  }
}

void conv_direct_weight_grad(const float* x, const float* gy, int64_t nb, const ConvGeom& g,
                             TapTable taps, const float* zeros, float* gw) {
  const int64_t L = g.L(), HWC = g.H * g.W * g.C, kk = g.kh * g.kw, K = kk * g.C;
  for (int64_t k0 = 0; k0 < K; k0 += kRows)  // C % 8 == 0: K too
    for (int64_t o0 = 0; o0 < g.O; o0 += 32) {
      if (g.O - o0 >= 32)
        weight_grad_tile<2>(x, gy, nb, L, HWC, taps.pixel, kk, g.C, g.O, k0, o0, zeros, gw);
      else
        weight_grad_tile<1>(x, gy, nb, L, HWC, taps.pixel, kk, g.C, g.O, k0, o0, zeros, gw);
    }
}

#pragma GCC pop_options

#else  // not x86-64 with GCC's builtins: the channels-last GEMM path serves

bool conv_direct_serves(ConvKind, const ConvGeom&) { return false; }

[[noreturn]] static void unavailable() {
  throw std::logic_error("[conv] the direct kernels need x86-64 with AVX-512");
}
void conv_direct_forward(const float*, int64_t, const ConvGeom&, TapTable, const float*,
                         const float*, float*) {
  unavailable();
}
void conv_direct_input_grad(const float*, int64_t, const ConvGeom&, TapTable, const float*,
                            float*) {
  unavailable();
}
void conv_direct_weight_grad(const float*, const float*, int64_t, const ConvGeom&, TapTable,
                             const float*, float*) {
  unavailable();
}

#endif

}  // namespace quanta::cpu
