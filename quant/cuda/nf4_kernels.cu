// CUDA entries nf4_absmax, nf4_encode, nf4_decode, nf4_linear and
// nf4_linear_grad (quant/kernels/table.h). Scaling, codes and values are
// quant/kernels/functors.h's (the CPU's, so the bytes are bitsandbytes'); the
// linear layer runs small batches through the fused GEMV (nf4_gemv.cu) and
// otherwise dequantizes a bounded tile of weight rows at a time (plans.h)
// and hands it to cuBLAS: in bf16 on the tensor cores for bf16 compute
// (plans.h: nf4_bf16_products), else in the data's dtype.
#include <stdexcept>
#include <string>
#include <type_traits>

#include "quant/cuda/device.cuh"
#include "quant/cuda/kernels.h"
#include "quant/cuda/nf4_gemv.h"
#include "quant/kernels/functors.h"

namespace quanta::quant::quant_cuda {
namespace {

// A warp per block of bs elements: the max |x|, NaN ignored (max is exact,
// so the lanes' order does not matter).
__global__ void absmax_kernel(const float* x, int64_t n, int64_t bs, int64_t blocks,
                              float* absmax) {
  const int lane = threadIdx.x % kWarp;
  QUANTA_WARP_STRIDE(b, blocks) {
    const int64_t begin = b * bs, len = bs < n - begin ? bs : n - begin;
    float a = 0.0f;
    for (int64_t i = lane; i < len; i += kWarp) a = fn::nf4_absmax_step(a, x[begin + i]);
    for (int o = kWarp / 2; o > 0; o /= 2) a = fn::max_of(a, __shfl_xor_sync(0xffffffffu, a, o));
    if (lane == 0) absmax[b] = a;
  }
}

// One thread per packed byte of each run of R codes: two elements scaled
// by their block's absmax and coded; past the end, code 7 (0).
__global__ void encode_kernel(const float* x, int64_t n, int64_t bs, const float* absmax,
                              const float* stored, NF4RunsOut out, int64_t runs) {
  const int64_t R = out.run, per_run = R / 2;
  QUANTA_GRID_STRIDE(t, runs * per_run) {
    const int64_t r = t / per_run, j = t % per_run;
    const int64_t start = r * R, b = start / bs;
    const int64_t len = bs < n - b * bs ? bs : n - b * bs;
    const int64_t rlen = R < n - start ? R : n - start;
    if (rlen < R && !out.pad_runs && 2 * j >= rlen) continue;
    const float a = fn::nf4_block_scale(absmax[b]);
    const float inv = 1.0f / a;
    int code[2];
    for (int h = 0; h < 2; ++h) {
      const int64_t i = start + 2 * j + h;
      code[h] = fn::nf4_code(i < n ? fn::nf4_scaled(x[i], a, inv, len == bs) : 0.0f);
    }
    out.codes[r * out.code_stride + j] = static_cast<uint8_t>((code[0] << 4) | code[1]);
    if (j == 0 && out.scales) memcpy(out.scales + r * out.scale_stride, stored + b, sizeof(float));
  }
}

// The 16 values in shared memory, once per block (a lookup by a run-time
// code in a local array would go through local memory).
__device__ inline void load_values(float (&values)[16]) {
  if (threadIdx.x < 16) values[threadIdx.x] = fn::nf4_value(static_cast<int>(threadIdx.x));
  __syncthreads();
}

// Element i of w as nf4_decode writes it: D(round_to(value * scale, dd)).
template <class D>
__device__ inline D decoded(const float (&values)[16], int code, float scale, DType dd) {
  return cuda::convert<D>(round_to(values[code] * scale, dd));
}

// Elements [begin, begin + count) of w, a thread each (any begin, count or
// alignment).
template <class D>
__global__ void decode_kernel(NF4Runs w, int64_t begin, int64_t count, DType dd, D* out) {
  __shared__ float values[16];
  load_values(values);
  QUANTA_GRID_STRIDE(t, count) {
    const int64_t i = begin + t, r = fn::nf4_run_of(w, i);
    const int code = fn::nf4_nibble(fn::nf4_run_codes(w, r), i - r * w.run);
    out[t] = decoded<D>(values, code, fn::nf4_run_scale(w, r), dd);
  }
}

// The C decoded values at p (16-byte aligned: one thread's piece) as one
// 16-byte store.
template <class D, int C>
__device__ inline void store16(D* p, const D (&v)[C]) {
  static_assert(C * sizeof(D) == kNF4DecodeStoreBytes, "a piece fills one 16-byte store");
  if constexpr (sizeof(D) == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else if constexpr (sizeof(D) == 8) {
    *reinterpret_cast<double2*>(p) = make_double2(v[0], v[1]);
  } else {
    static_assert(sizeof(D) == 2, "f32, f64 or a 16-bit float");
    uint32_t half[C];
#pragma unroll
    for (int j = 0; j < C; ++j) {
      uint16_t bits;
      memcpy(&bits, &v[j], sizeof bits);
      half[j] = bits;
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(half[0] | half[1] << 16, half[2] | half[3] << 16,
                                              half[4] | half[5] << 16, half[6] | half[7] << 16);
  }
}

// Words [0, words) of packed codes from element `begin` (a multiple of 8),
// 16 bytes of output a thread (plans.h: nf4_decode_piece): a word never
// leaves its run (runs are 32 or 64 codes), so one scale serves its values.
// A thread loads the words and scales of kDecodeLoadsAhead pieces before it
// decodes and stores any (cuda::grid_stride_loads_first): one piece at a
// time kept one 4-byte word and one scale in flight per thread, some 8 KiB
// an SM, where the H200's bandwidth times its latency asks about 25.
// nf4_decode_split says when this applies.
constexpr int kDecodeLoadsAhead = 4;

template <class D>
__global__ void decode_words_kernel(NF4Runs w, int64_t begin, int64_t threads, DType dd, D* out) {
  constexpr int C = static_cast<int>(nf4_decode_thread_codes(sizeof(D)));
  __shared__ float values[16];
  load_values(values);
  struct Loaded {
    uint32_t word;
    float scale;
  };
  cuda::grid_stride_loads_first<kDecodeLoadsAhead>(
      threads,
      [&](int64_t t) {
        const NF4DecodePiece piece = nf4_decode_piece<sizeof(D)>(t);
        const int64_t i = begin + piece.word * kNF4WordCodes, r = fn::nf4_run_of(w, i);
        return Loaded{
            __ldg(reinterpret_cast<const uint32_t*>(fn::nf4_run_codes(w, r) + (i - r * w.run) / 2)),
            __ldg(reinterpret_cast<const float*>(fn::nf4_run_scale_bytes(w, r)))};
      },
      [&](int64_t t, const Loaded& l) {
        const int first_code = nf4_decode_piece<sizeof(D)>(t).first_code;
        D v[C];
#pragma unroll
        for (int j = 0; j < C; ++j)
          v[j] = decoded<D>(values, fn::nf4_word_code(l.word, first_code + j), l.scale, dd);
        store16<D, C>(out + t * C, v);
      });
}

// Elements [begin, begin + count) of w into out: whole words by the word
// kernel where they can be, the rest a thread per element.
template <class D>
void decode(const NF4Runs& w, int64_t begin, int64_t count, DType dd, D* out) {
  const NF4DecodeSplit s = nf4_decode_split(w, begin, count, out);
  const int64_t threads = nf4_decode_threads(s.words, sizeof(D));
  const cuda::LaunchConfig gw = grid_for(threads);
  if (gw.blocks > 0) {
    decode_words_kernel<D><<<static_cast<unsigned>(gw.blocks), gw.threads, 0, cuda::stream()>>>(
        w, begin, threads, dd, out);
    QUANTA_CUDA_CHECK_LAUNCH();
  }
  const cuda::LaunchConfig ge = grid_for(s.tail_count);
  if (ge.blocks > 0) {
    decode_kernel<D><<<static_cast<unsigned>(ge.blocks), ge.threads, 0, cuda::stream()>>>(
        w, s.tail_begin, s.tail_count, dd, out + (s.tail_begin - begin));
    QUANTA_CUDA_CHECK_LAUNCH();
  }
}

template <class T>
__global__ void add_bias_kernel(const T* bias, int64_t m, int64_t n, T* y) {
  QUANTA_GRID_STRIDE(i, m * n) { y[i] += bias[i % n]; }
}

void check_dequant(const char* op, DType dd) {
  if (dd != DType::f32 && dd != DType::bf16 && dd != DType::f16)
    cuda::bad_dtype(op, dd, "nf4 dequantizes to f32, bf16 or f16");
}

// out[i] = x[i] rounded to bf16 (to nearest even, as the CPU's round_to_bf16).
__global__ void round_bf16_kernel(const float* x, int64_t n, __nv_bfloat16* out) {
  QUANTA_GRID_STRIDE(i, n) { out[i] = __float2bfloat16_rn(x[i]); }
}

// out = n f32 values rounded to bf16 (the activation of a bf16 product).
void round_bf16(const float* x, int64_t n, __nv_bfloat16* out) {
  const cuda::LaunchConfig g = grid_for(n);
  if (g.blocks == 0) return;
  round_bf16_kernel<<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(x, n, out);
  QUANTA_CUDA_CHECK_LAUNCH();
}

// Calls product(n0, r, tile) for each tile of weight rows [n0, n0 + r), K
// values each, decoded to D (rounded to dd) into one reused buffer of
// nf4_tile_rows rows: every tiled product, f32 or bf16, forward or backward.
template <class D, class Product>
void for_each_tile(const NF4Runs& w, int64_t N, int64_t K, DType dd, Product&& product) {
  const int64_t rows = nf4_tile_rows(N, K);
  Scratch<D> tile(rows * K);
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    const int64_t r = std::min(rows, N - n0);
    decode<D>(w, n0 * K, r * K, dd, tile.get());
    product(n0, r, static_cast<const D*>(tile.get()));
  }
}

// The tiled products in bf16 (plans.h: nf4_bf16_products): the f32 ones'
// layouts (below), bf16 operands, f32 output.
// x rounded (shared: already in `rounded`, when set) then multiplied.
void forward_bf16(const float* x, const __nv_bfloat16* rounded, int64_t M, int64_t K,
                  const NF4Runs& w, int64_t N, float* y) {
  const Scratch<__nv_bfloat16> own(rounded ? 0 : M * K);
  if (!rounded) round_bf16(x, M * K, own.get());
  const __nv_bfloat16* xb = rounded ? rounded : own.get();
  for_each_tile<__nv_bfloat16>(w, N, K, DType::bf16, [&](int64_t n0, int64_t r, auto tile) {
    gemm_bf16(CUBLAS_OP_T, CUBLAS_OP_N, r, M, K, tile, K, xb, K, 0.0f, y + n0, N);
  });
}

void backward_bf16(const float* g, int64_t M, int64_t N, const NF4Runs& w, int64_t K, float* dx,
                   bool accumulate) {
  const Scratch<__nv_bfloat16> gb(M * N);
  round_bf16(g, M * N, gb.get());
  for_each_tile<__nv_bfloat16>(w, N, K, DType::bf16, [&](int64_t n0, int64_t r, auto tile) {
    gemm_bf16(CUBLAS_OP_N, CUBLAS_OP_N, K, M, r, tile, K, gb.get() + n0, N,
              accumulate || n0 > 0 ? 1.0f : 0.0f, dx, K);
  });
}

// y [M, N] = x [M, K] W^T: small batches decoded in registers, larger ones
// with W dequantized `rows` weight rows at a time.
template <class T>
void forward(const T* x, const __nv_bfloat16* rounded, int64_t M, int64_t K, const NF4Runs& w,
             DType dd, int64_t N, const T* bias, T* y) {
  if (M == 0 || N == 0) return;
  if (nf4_use_gemv(M, K, N, w)) return nf4_gemv<T>(x, M, K, w, dd, N, bias, y);
  if (K == 0) {
    QUANTA_CUDA_CHECK(cudaMemsetAsync(y, 0, sizeof(T) * M * N, cuda::stream()));
  } else if (nf4_bf16_products(std::is_same_v<T, float>, dd, M)) {
    if constexpr (std::is_same_v<T, float>) forward_bf16(x, rounded, M, K, w, N, y);
  } else {
    for_each_tile<T>(w, N, K, dd, [&](int64_t n0, int64_t r, const T* tile) {
      // y^T[n0:n0+r, :] (column-major, ld N) = tile [r, K] x^T: tile read as
      // column-major [K, r] and transposed, x as column-major [K, M].
      gemm<T>(CUBLAS_OP_T, CUBLAS_OP_N, r, M, K, T(1), tile, K, x, K, T(0), y + n0, N);
    });
  }
  if (bias) {
    const cuda::LaunchConfig g = grid_for(M * N);
    add_bias_kernel<T>
        <<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(bias, M, N, y);
    QUANTA_CUDA_CHECK_LAUNCH();
  }
}

// dx [M, K] = (or +=) g [M, N] W, summed over the weight tiles.
template <class T>
void backward(const T* g, int64_t M, int64_t N, const NF4Runs& w, DType dd, int64_t K, T* dx,
              bool accumulate) {
  if (M == 0 || K == 0) return;
  if (N == 0) {
    if (!accumulate) QUANTA_CUDA_CHECK(cudaMemsetAsync(dx, 0, sizeof(T) * M * K, cuda::stream()));
    return;
  }
  if (nf4_bf16_products(std::is_same_v<T, float>, dd, M)) {
    if constexpr (std::is_same_v<T, float>) backward_bf16(g, M, N, w, K, dx, accumulate);
    return;
  }
  for_each_tile<T>(w, N, K, dd, [&](int64_t n0, int64_t r, const T* tile) {
    // dx^T [K, M] (column-major, ld K) += tile^T g[:, n0:n0+r]^T: the tile
    // read as column-major [K, r], g's columns as column-major [r, M], ld N.
    gemm<T>(CUBLAS_OP_N, CUBLAS_OP_N, K, M, r, T(1), tile, K, g + n0, N,
            T(accumulate || n0 > 0 ? 1 : 0), dx, K);
  });
}

}  // namespace

void nf4_absmax(const float* x, int64_t n, int64_t block, float* absmax) {
  const int64_t blocks = n > 0 ? (n + block - 1) / block : 0;
  const cuda::LaunchConfig g = warp_grid_for(blocks);
  if (g.blocks == 0) return;
  absmax_kernel<<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(x, n, block,
                                                                                   blocks, absmax);
  QUANTA_CUDA_CHECK_LAUNCH();
}

void nf4_encode(const float* x, int64_t n, int64_t block, const float* absmax, const float* stored,
                const NF4RunsOut& out) {
  if ((out.run != 32 && out.run != 64) || block % out.run != 0)
    throw std::logic_error("[nf4 encode] block " + std::to_string(block) +
                           " is not whole runs of " + std::to_string(out.run));
  const int64_t runs = (n + out.run - 1) / out.run;
  const cuda::LaunchConfig g = grid_for(runs * (out.run / 2));
  if (g.blocks == 0) return;
  encode_kernel<<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(
      x, n, block, absmax, stored, out, runs);
  QUANTA_CUDA_CHECK_LAUNCH();
}

void nf4_decode(const NF4Runs& w, DType dtype, void* out) {
  if (w.n == 0) return;
  switch (dtype) {
    case DType::f32:
      return decode<float>(w, 0, w.n, DType::f32, static_cast<float*>(out));
    case DType::bf16:
      return decode<__nv_bfloat16>(w, 0, w.n, DType::f32, static_cast<__nv_bfloat16*>(out));
    case DType::f16:
      return decode<__half>(w, 0, w.n, DType::f32, static_cast<__half*>(out));
    default:
      cuda::bad_dtype("dequantize", dtype, "nf4 dequantizes to f32, bf16 or f16");
  }
}

void nf4_linear(DType dtype, const void* x, int64_t m, int64_t k, const NF4Runs& w, DType dequant,
                int64_t n, const void* bias, void* y, Bf16Input xb) {
  check_dequant("nf4_linear", dequant);
  if (xb.data && dtype != DType::f32)
    throw std::logic_error("[nf4_linear] a shared bf16 input needs an f32 x");
  auto* rounded = static_cast<__nv_bfloat16*>(xb.data);
  if (xb.write) round_bf16(static_cast<const float*>(x), m * k, rounded);
  cuda::dispatch_float(dtype, "nf4_linear", [&](auto tag) {
    using T = typename decltype(tag)::type;
    forward<T>(static_cast<const T*>(x), rounded, m, k, w, dequant, n, static_cast<const T*>(bias),
               static_cast<T*>(y));
  });
}

void nf4_linear_grad(DType dtype, const void* g, int64_t m, int64_t n, const NF4Runs& w,
                     DType dequant, int64_t k, void* dx, bool accumulate) {
  check_dequant("nf4_linear backward", dequant);
  cuda::dispatch_float(dtype, "nf4_linear backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    backward<T>(static_cast<const T*>(g), m, n, w, dequant, k, static_cast<T*>(dx), accumulate);
  });
}

}  // namespace quanta::quant::quant_cuda
