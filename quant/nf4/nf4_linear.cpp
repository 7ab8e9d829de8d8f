#include "quant/nf4/nf4_linear.h"

#include <algorithm>
#include <cstring>
#include <memory>
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
#include "quant/nf4/nf4_runs.h"
#include "quant/nf4/nf4_simd.h"

namespace quanta::quant {
namespace {

using detail::NF4Runs;

// Below this many rows per thread, backward runs one row block (the tiles'
// GEMMs are then threaded by Eigen instead).
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
        case 1: return fused_rows_f32<1, R>(x, K, w, dd, N, y, lo, hi);
        case 2: return fused_rows_f32<2, R>(x, K, w, dd, N, y, lo, hi);
        case 3: return fused_rows_f32<3, R>(x, K, w, dd, N, y, lo, hi);
        case 4: return fused_rows_f32<4, R>(x, K, w, dd, N, y, lo, hi);
        case 5: return fused_rows_f32<5, R>(x, K, w, dd, N, y, lo, hi);
        case 6: return fused_rows_f32<6, R>(x, K, w, dd, N, y, lo, hi);
        case 7: return fused_rows_f32<7, R>(x, K, w, dd, N, y, lo, hi);
        default: return fused_rows_f32<8, R>(x, K, w, dd, N, y, lo, hi);
      }
    }
#endif
    fused_rows_scalar<T, R>(x, M, K, w, dd, N, y, lo, hi);
  });
}

// y [M, N] = x [M, K] W^T, W dequantized tile by tile. Threads take whole
// tiles (each dequantizes its own into a private buffer and runs a
// single-threaded GEMM), so there is one parallel region per call.
template <class T>
void forward_kernel(const T* x, int64_t M, int64_t K, const NF4Runs& w, DType dd, int64_t N,
                    T* y) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    std::fill(y, y + M * N, T(0));
    return;
  }
  if (M <= kNF4FusedMaxBatch && K % w.run == 0) {
    if (w.run == 32) fused_small_batch<T, 32>(x, M, K, w, dd, N, y);
    else fused_small_batch<T, 64>(x, M, K, w, dd, N, y);
    return;
  }
  const int64_t rows = tile_rows(N, K, w.run);
  const int64_t tiles = (N + rows - 1) / rows;
  cpu::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
    std::vector<T> tile(static_cast<size_t>(rows * K));
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n0 = t * rows, r = std::min(rows, N - n0);
      detail::decode_range(w, n0 * K, r * K, dd, tile.data());
      // tile^T as a [K, r] operand: element (k, n) at tile[n * K + k].
      cpu::gemm<T>(M, r, K, {x, K, 1}, {tile.data(), 1, K}, y + n0, N);
    }
  });
}

// dx [M, K] = g [M, N] W. Threads take row blocks of dx (so no two write the
// same output) and each walks all weight tiles.
template <class T>
void backward_kernel(const T* g, int64_t M, int64_t N, const NF4Runs& w, DType dd, int64_t K,
                     T* dx) {
  if (M == 0 || K == 0) return;
  if (N == 0) {
    std::fill(dx, dx + M * K, T(0));
    return;
  }
  const int64_t rows = tile_rows(N, K, w.run);
  cpu::parallel_for(0, M, kBackwardRowGrain, [&](int64_t m0, int64_t m1) {
    std::vector<T> tile(static_cast<size_t>(rows * K));
    for (int64_t n0 = 0; n0 < N; n0 += rows) {
      const int64_t r = std::min(rows, N - n0);
      detail::decode_range(w, n0 * K, r * K, dd, tile.data());
      cpu::gemm<T>(m1 - m0, K, r, {g + m0 * N + n0, N, 1}, {tile.data(), K, 1}, dx + m0 * K, K,
                   n0 > 0);
    }
  });
}

// The weight as the kernels see it, kept alive by backward: the nf4 tensor,
// or bitsandbytes' packed codes with their f32 scales (reconstructed once per
// call from the double-quantized state).
struct Weight {
  Tensor nf4;
  Tensor packed, scales;
  int64_t block = kNF4UnitElems;
  int64_t n_out = 0, n_in = 0;

  NF4Runs runs() const {
    if (nf4.defined()) return detail::unit_runs(nf4);
    return detail::packed_runs(packed.data<uint8_t>(), scales.data<float>(), n_out * n_in,
                               block);
  }
};

void check_args(const Tensor& x, const Shape& w_shape, const Tensor& bias, DType dd) {
  if (w_shape.size() != 2)
    throw std::invalid_argument("[nf4_linear] weight must be 2-d [out, in], got shape " +
                                shape_str(w_shape));
  if (!x.defined() || x.dim() < 1 || x.size(-1) != w_shape[1])
    throw std::invalid_argument("[nf4_linear] input's last dim must be in = " +
                                std::to_string(w_shape[1]) + ", got shape " +
                                (x.defined() ? shape_str(x.shape()) : "undefined"));
  if (x.dtype() != DType::f32 && x.dtype() != DType::f64)
    throw std::invalid_argument(std::string("[nf4_linear] input dtype must be f32 or f64, got ") +
                                dtype_name(x.dtype()));
  if (!x.device().is_cpu())
    throw std::invalid_argument("[nf4_linear] input is on " + x.device().str() +
                                "; only the CPU kernel exists");
  if (bias.defined() && (bias.shape() != Shape{w_shape[0]} || bias.dtype() != x.dtype()))
    throw std::invalid_argument("[nf4_linear] bias must be [" + std::to_string(w_shape[0]) +
                                "] of the input's dtype, got " + shape_str(bias.shape()) + " " +
                                dtype_name(bias.dtype()));
  detail::check_dequant_dtype(dd, "nf4_linear");
}

Tensor linear_impl(const Tensor& x, std::shared_ptr<const Weight> w, const Tensor& bias,
                   DType dd) {
  const int64_t K = w->n_in, N = w->n_out;
  const int64_t M = numel_of(Shape(x.shape().begin(), x.shape().end() - 1));
  Shape out_shape = x.shape();
  out_shape.back() = N;
  const Tensor xc = x.detach().contiguous();
  Tensor y = quanta::detail::make_tensor(out_shape, x.dtype(), Device::cpu());
  dispatch_float(x.dtype(), "nf4_linear", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* py = static_cast<T*>(y.raw_data());
    forward_kernel(static_cast<const T*>(xc.raw_data()), M, K, w->runs(), dd, N, py);
    if (bias.defined() && M > 0) {
      const Tensor bc = bias.detach().contiguous();
      const T* pb = static_cast<const T*>(bc.raw_data());
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) py[m * N + n] += pb[n];
    }
  });
  std::vector<Tensor> inputs{x};
  if (bias.defined()) inputs.push_back(bias);
  // Backward keeps only the packed weight and its scales.
  return autograd::record("nf4_linear", y, inputs,
                          [w, dd, x_shape = x.shape(), has_bias = bias.defined(), M, N,
                           K](const Tensor& g) {
    const Tensor gc = g.contiguous();
    Tensor dx = quanta::detail::make_tensor(x_shape, g.dtype(), Device::cpu());
    dispatch_float(g.dtype(), "nf4_linear backward", [&](auto tag) {
      using T = typename decltype(tag)::type;
      backward_kernel(static_cast<const T*>(gc.raw_data()), M, N, w->runs(), dd, K,
                      static_cast<T*>(dx.raw_data()));
    });
    std::vector<Tensor> grads{dx};
    if (has_bias) grads.push_back(sum(gc.reshape({M, N}), {0}));
    return grads;
  });
}

}  // namespace

Tensor nf4_linear(const Tensor& x, const Tensor& w, const Tensor& bias, DType dequant_dtype) {
  check_nf4(w, "nf4_linear");
  check_args(x, w.shape(), bias, dequant_dtype);
  auto weight = std::make_shared<Weight>();
  weight->nf4 = w;
  weight->n_out = w.size(0);
  weight->n_in = w.size(1);
  return linear_impl(x, std::move(weight), bias, dequant_dtype);
}

Tensor nf4_linear(const Tensor& x, const BnbNF4State& w, const Tensor& bias,
                  DType dequant_dtype) {
  check_args(x, w.shape, bias, dequant_dtype);
  auto weight = std::make_shared<Weight>();
  weight->scales = bnb_scales(w);  // checks the state
  weight->packed = w.packed.detach().to(Device::cpu()).to(DType::u8).contiguous();
  weight->block = w.blocksize;
  weight->n_out = w.shape[0];
  weight->n_in = w.shape[1];
  return linear_impl(x, std::move(weight), bias, dequant_dtype);
}

}  // namespace quanta::quant
