#include "quant/nf4/nf4_linear.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>


#include "engine/autograd/grad_mode.h"
#include "engine/autograd/node.h"
#include "engine/cpu/gemm.h"
#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "quant/nf4/nf4_format.h"
#include "quant/nf4/nf4_simd.h"

namespace quanta::quant {
namespace {

// Elements of one dequantized weight tile (4 MiB of f32): large enough for an
// efficient GEMM, a sixteenth of a 4096 x 4096 weight.
constexpr int64_t kTileElems = int64_t{1} << 20;
// Below this many rows per thread, backward runs one row block (the tiles'
// GEMMs are then threaded by Eigen instead).
constexpr int64_t kBackwardRowGrain = 64;

// Rows per tile: a multiple of the rows after which a row starts a unit
// again, so each tile starts on a 64-element unit.
int64_t tile_rows(int64_t n_rows, int64_t k) {
  int64_t align = 1;
  while ((align * k) % kNF4UnitElems != 0) ++align;
  int64_t rows = std::max<int64_t>(1, kTileElems / std::max<int64_t>(k, 1));
  rows = std::max(align, rows / align * align);
  return std::min(rows, n_rows);
}

const uint8_t* unit_at(const uint8_t* base, int64_t unit) {
  return base + unit * static_cast<int64_t>(kNF4UnitBytes);
}

float unit_scale(const uint8_t* unit) {
  float s;
  std::memcpy(&s, unit + kNF4CodeBytes, sizeof s);
  return s;
}

#if defined(__AVX512F__)
// y[m, n] for MB rows of x: per unit, sum x * value(code) over its 64
// elements, then scale once by the unit's f32 scale.
template <int MB>
void fused_rows_f32(const float* x, int64_t K, const uint8_t* w, int64_t N, float* y,
                    int64_t lo, int64_t hi) {
  const __m512 values = _mm512_loadu_ps(kNF4Values.data());
  const int64_t units_per_row = K / kNF4UnitElems;
  for (int64_t n = lo; n < hi; ++n) {
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t u = 0; u < units_per_row; ++u) {
      const uint8_t* unit = unit_at(w, n * units_per_row + u);
      const __m512 s = _mm512_set1_ps(unit_scale(unit));
      const int64_t k0 = u * kNF4UnitElems;
      __m512 part[MB];
      for (int m = 0; m < MB; ++m) part[m] = _mm512_setzero_ps();
      for (int g = 0; g < 4; ++g) {
        uint64_t eight;
        std::memcpy(&eight, unit + 8 * g, 8);
        const __m512 wv = simd::decode16(eight, values);
        for (int m = 0; m < MB; ++m)
          part[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k0 + 16 * g), part[m]);
      }
      for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(part[m], s, acc[m]);
    }
    for (int m = 0; m < MB; ++m) y[m * N + n] = _mm512_reduce_add_ps(acc[m]);
  }
}
#define QUANTA_NF4_FUSED_SIMD 1
#elif defined(__AVX2__)
template <int MB>
void fused_rows_f32(const float* x, int64_t K, const uint8_t* w, int64_t N, float* y,
                    int64_t lo, int64_t hi) {
  const __m256 lo_vals = _mm256_loadu_ps(kNF4Values.data());
  const __m256 hi_vals = _mm256_loadu_ps(kNF4Values.data() + 8);
  const int64_t units_per_row = K / kNF4UnitElems;
  for (int64_t n = lo; n < hi; ++n) {
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t u = 0; u < units_per_row; ++u) {
      const uint8_t* unit = unit_at(w, n * units_per_row + u);
      const __m256 s = _mm256_set1_ps(unit_scale(unit));
      const int64_t k0 = u * kNF4UnitElems;
      __m256 part[MB];
      for (int m = 0; m < MB; ++m) part[m] = _mm256_setzero_ps();
      for (int g = 0; g < 8; ++g) {
        uint32_t four;
        std::memcpy(&four, unit + 4 * g, 4);
        const __m256 wv = simd::decode8(four, lo_vals, hi_vals);
        for (int m = 0; m < MB; ++m)
          part[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k0 + 8 * g), part[m]);
      }
      for (int m = 0; m < MB; ++m) acc[m] = _mm256_fmadd_ps(part[m], s, acc[m]);
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

// Portable form: the dequantized values code * scale (one f32 rounding, as
// dequantize()) times x, for MB <= 8 rows.
template <class T>
void fused_rows_scalar(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* y,
                       int64_t lo, int64_t hi) {
  const int64_t units_per_row = K / kNF4UnitElems;
  for (int64_t n = lo; n < hi; ++n) {
    T acc[kNF4FusedMaxBatch] = {};
    for (int64_t u = 0; u < units_per_row; ++u) {
      const uint8_t* unit = unit_at(w, n * units_per_row + u);
      const float s = unit_scale(unit);
      T lut[16];
      for (int c = 0; c < 16; ++c) lut[c] = static_cast<T>(kNF4Values[c] * s);
      const int64_t k0 = u * kNF4UnitElems;
      for (int64_t m = 0; m < M; ++m) {
        const T* xr = x + m * K + k0;
        T a = 0;
        for (size_t j = 0; j < kNF4CodeBytes; ++j)
          a += xr[2 * j] * lut[unit[j] >> 4] + xr[2 * j + 1] * lut[unit[j] & 15];
        acc[m] += a;
      }
    }
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = acc[m];
  }
}

// y[m, n] = sum_k x[m, k] W[n, k] for M <= 8 rows, reading each packed weight
// byte once (rows of W in parallel); needs K % 64 == 0 so rows are whole units.
template <class T>
void fused_small_batch(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* y) {
  const int64_t grain = std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(K, 1));
  cpu::parallel_for(0, N, grain, [&](int64_t lo, int64_t hi) {
#ifdef QUANTA_NF4_FUSED_SIMD
    if constexpr (std::is_same_v<T, float>) {
      switch (M) {
        case 1: return fused_rows_f32<1>(x, K, w, N, y, lo, hi);
        case 2: return fused_rows_f32<2>(x, K, w, N, y, lo, hi);
        case 3: return fused_rows_f32<3>(x, K, w, N, y, lo, hi);
        case 4: return fused_rows_f32<4>(x, K, w, N, y, lo, hi);
        case 5: return fused_rows_f32<5>(x, K, w, N, y, lo, hi);
        case 6: return fused_rows_f32<6>(x, K, w, N, y, lo, hi);
        case 7: return fused_rows_f32<7>(x, K, w, N, y, lo, hi);
        default: return fused_rows_f32<8>(x, K, w, N, y, lo, hi);
      }
    }
#endif
    fused_rows_scalar(x, M, K, w, N, y, lo, hi);
  });
}

// y [M, N] = x [M, K] W^T, W dequantized tile by tile. Threads take whole
// tiles (each dequantizes its own into a private buffer and runs a
// single-threaded GEMM), so there is one parallel region per call.
template <class T>
void forward_kernel(const T* x, int64_t M, int64_t K, const Tensor& w, int64_t N, T* y) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    std::fill(y, y + M * N, T(0));
    return;
  }
  if (M <= kNF4FusedMaxBatch && K % kNF4UnitElems == 0) {
    fused_small_batch(x, M, K, static_cast<const uint8_t*>(w.raw_data()), N, y);
    return;
  }
  const int64_t rows = tile_rows(N, K);
  const int64_t tiles = (N + rows - 1) / rows;
  cpu::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
    std::vector<T> tile(static_cast<size_t>(rows * K));
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n0 = t * rows, r = std::min(rows, N - n0);
      dequantize_range(w, n0 * K, r * K, tile.data());
      // tile^T as a [K, r] operand: element (k, n) at tile[n * K + k].
      cpu::gemm<T>(M, r, K, {x, K, 1}, {tile.data(), 1, K}, y + n0, N);
    }
  });
}

// dx [M, K] = g [M, N] W. Threads take row blocks of dx (so no two write the
// same output) and each walks all weight tiles.
template <class T>
void backward_kernel(const T* g, int64_t M, int64_t N, const Tensor& w, int64_t K, T* dx) {
  if (M == 0 || K == 0) return;
  if (N == 0) {
    std::fill(dx, dx + M * K, T(0));
    return;
  }
  const int64_t rows = tile_rows(N, K);
  cpu::parallel_for(0, M, kBackwardRowGrain, [&](int64_t m0, int64_t m1) {
    std::vector<T> tile(static_cast<size_t>(rows * K));
    for (int64_t n0 = 0; n0 < N; n0 += rows) {
      const int64_t r = std::min(rows, N - n0);
      dequantize_range(w, n0 * K, r * K, tile.data());
      cpu::gemm<T>(m1 - m0, K, r, {g + m0 * N + n0, N, 1}, {tile.data(), K, 1}, dx + m0 * K, K,
                   n0 > 0);
    }
  });
}

void check_args(const Tensor& x, const Tensor& w, const Tensor& bias) {
  check_nf4(w, "nf4_linear");
  if (w.dim() != 2)
    throw std::invalid_argument("[nf4_linear] weight must be 2-d [out, in], got shape " +
                                shape_str(w.shape()));
  if (!x.defined() || x.dim() < 1 || x.size(-1) != w.size(1))
    throw std::invalid_argument("[nf4_linear] input's last dim must be in = " +
                                std::to_string(w.size(1)) + ", got shape " +
                                (x.defined() ? shape_str(x.shape()) : "undefined"));
  if (x.dtype() != DType::f32 && x.dtype() != DType::f64)
    throw std::invalid_argument(std::string("[nf4_linear] input dtype must be f32 or f64, got ") +
                                dtype_name(x.dtype()));
  if (!x.device().is_cpu())
    throw std::invalid_argument("[nf4_linear] input is on " + x.device().str() +
                                "; only the CPU kernel exists");
  if (bias.defined() && (bias.shape() != Shape{w.size(0)} || bias.dtype() != x.dtype()))
    throw std::invalid_argument("[nf4_linear] bias must be [" + std::to_string(w.size(0)) +
                                "] of the input's dtype, got " + shape_str(bias.shape()) + " " +
                                dtype_name(bias.dtype()));
}

}  // namespace

Tensor nf4_linear(const Tensor& x, const Tensor& w, const Tensor& bias) {
  check_args(x, w, bias);
  const int64_t K = w.size(1), N = w.size(0);
  const int64_t M = numel_of(Shape(x.shape().begin(), x.shape().end() - 1));
  Shape out_shape = x.shape();
  out_shape.back() = N;
  const Tensor xc = x.detach().contiguous();
  Tensor y = detail::make_tensor(out_shape, x.dtype(), Device::cpu());
  dispatch_float(x.dtype(), "nf4_linear", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* py = static_cast<T*>(y.raw_data());
    forward_kernel(static_cast<const T*>(xc.raw_data()), M, K, w, N, py);
    if (bias.defined() && M > 0) {
      const Tensor bc = bias.detach().contiguous();
      const T* pb = static_cast<const T*>(bc.raw_data());
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) py[m * N + n] += pb[n];
    }
  });
  std::vector<Tensor> inputs{x};
  if (bias.defined()) inputs.push_back(bias);
  // Backward keeps only the packed weight (4.5 bits per parameter).
  return autograd::record("nf4_linear", y, inputs,
                          [w, x_shape = x.shape(), has_bias = bias.defined(), M, N,
                           K](const Tensor& g) {
    const Tensor gc = g.contiguous();
    Tensor dx = detail::make_tensor(x_shape, g.dtype(), Device::cpu());
    dispatch_float(g.dtype(), "nf4_linear backward", [&](auto tag) {
      using T = typename decltype(tag)::type;
      backward_kernel(static_cast<const T*>(gc.raw_data()), M, N, w, K,
                      static_cast<T*>(dx.raw_data()));
    });
    std::vector<Tensor> grads{dx};
    if (has_bias) grads.push_back(sum(gc.reshape({M, N}), {0}));
    return grads;
  });
}

}  // namespace quanta::quant
