// nf4_linear for small batches (plans.h: nf4_use_gemv): y [M, N] = x [M, K]
// W^T (+ bias), each packed weight word read once from global memory and
// dequantized in registers, never written anywhere. The 16 code values, the
// word's codes and the run's scale are quant/kernels/functors.h's, rounded to
// the dequant dtype as nf4_decode rounds them.
//
// A block takes kNF4GemvBlockRows weight rows; each warp takes
// kNF4GemvRowsPerWarp of them. Lane l of a warp handles columns 8 l .. 8 l +
// 7 of every 256, one 32-bit word of codes per weight row, so a warp's loads
// of a row's codes are contiguous; the words of kStepsInFlight steps are
// loaded before any is decoded. Each lane sums its products in T; one warp
// sum per output ends the row. The `staged` kernel (plans.h: NF4GemvKind)
// stages `chunk` columns of every row of x in shared memory per pass (each x
// value then comes from global memory once per block, not once per weight
// row); the `unstaged` one reads a lane's 8 values of x from global memory in
// two 16-byte loads through the L1 cache, which the multiprocessor's warps
// share: no passes, no barriers. Both sum in the same order.
#include <cstdlib>
#include <stdexcept>
#include <type_traits>

#include "quant/cuda/device.cuh"
#include "quant/cuda/nf4_gemv.h"
#include "quant/kernels/functors.h"

namespace quanta::quant::quant_cuda {
namespace {

constexpr int kRows = kNF4GemvRowsPerWarp;
constexpr int kCodes = static_cast<int>(kNF4GemvCodesPerLane);
constexpr int kStepsInFlight = kNF4GemvStepsInFlight;

// The 8 staged values of x at p (16-byte aligned: nf4_gemv_slot) as 16-byte
// shared-memory loads.
__device__ inline void load8(const float* p, float (&v)[kCodes]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ inline void load8(const double* p, double (&v)[kCodes]) {
#pragma unroll
  for (int q = 0; q < kCodes / 2; ++q) {
    const double2 d = *reinterpret_cast<const double2*>(p + 2 * q);
    v[2 * q] = d.x, v[2 * q + 1] = d.y;
  }
}

// The 8 values of x at p (16-byte aligned) from global memory, through L1.
__device__ inline void load8_global(const float* p, float (&v)[kCodes]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p + 4));
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ inline void load8_global(const double* p, double (&v)[kCodes]) {
#pragma unroll
  for (int q = 0; q < kCodes / 2; ++q) {
    const double2 d = __ldg(reinterpret_cast<const double2*>(p + 2 * q));
    v[2 * q] = d.x, v[2 * q + 1] = d.y;
  }
}

// The weight rows a warp of a block at n0 takes; rows past N repeat row N -
// 1 (every load stays in bounds) and their results are never written.
__device__ inline void warp_rows(int64_t n0, int warp, int64_t N, int64_t (&row)[kRows]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t n = n0 + warp * kRows + r;
    row[r] = n < N ? n : N - 1;
  }
}

// The warp's sums of acc, written by lane 0 (bias added) for rows below N.
template <class T, int MB>
__device__ inline void write_rows(const T (&acc)[kRows][MB], int64_t n0, int warp, int lane,
                                  int64_t N, const T* bias, T* y) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t n = n0 + warp * kRows + r;
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      const T sum = warp_sum(acc[r][m]);
      if (lane == 0 && n < N) y[m * N + n] = bias ? sum + bias[n] : sum;
    }
  }
}

// Code j's value from the 16 values at shared address `table` (256-byte
// aligned: its low byte is 0), `o` the word's nf4_word_offsets: one PRMT
// puts the code's byte offset into the table's address, where a shift and a
// LOP3 per code formed it before (and indexing the shared array adds its
// base per code, a further instruction: the SASS of values[code]); the
// 32-bit address made generic is known to be shared, so this is one LDS.
__device__ inline float code_value(uint32_t table, const fn::NF4WordOffsets& o, int j) {
  const uint32_t address = __byte_perm(j % 2 ? o.odd : o.even, table, 0x7650u | (j / 2));
  return *static_cast<const float*>(__cvta_shared_to_generic(address));
}

// Row r's 8 decoded values of one word of codes: value * scale rounded to
// dd, or the bare value where the scale multiplies the sum instead.
template <class T>
__device__ inline void decode_word(uint32_t table, uint32_t word, float scale, DType dd,
                                   bool scale_after, T (&wv)[kCodes]) {
  const fn::NF4WordOffsets o = fn::nf4_word_offsets(word);
#pragma unroll
  for (int j = 0; j < kCodes; ++j) {
    const float v = code_value(table, o, j);
    wv[j] = static_cast<T>(scale_after ? v : round_to(v * scale, dd));
  }
}

// a * b rounded, never fused into the sum it is added to: the kernels'
// scaled sums stay the same bits whatever the compiler contracts.
__device__ inline float unfused_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ inline double unfused_mul(double a, double b) { return __dmul_rn(a, b); }

// acc[r][m] += row r's 8 decoded values . the 8 values of x's row m, which
// load(m, xv) fetches (both kernels sum the same way).
template <class T, int MB, class Load>
__device__ inline void accumulate8(const T (&wv)[kRows][kCodes], const float (&scale)[kRows],
                                   bool scale_after, Load load, T (&acc)[kRows][MB]) {
#pragma unroll
  for (int m = 0; m < MB; ++m) {
    T xv[kCodes];
    load(m, xv);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      T dot = T(0);
#pragma unroll
      for (int j = 0; j < kCodes; ++j) dot += wv[r][j] * xv[j];
      acc[r][m] += scale_after ? unfused_mul(static_cast<T>(scale[r]), dot) : dot;
    }
  }
}

// What every group of steps of a lane reads alike.
struct StepArgs {
  NF4GemvSteps steps;
  int64_t x_row, x_step;  // a lane's x: row m at xl + m * x_row, a step x_step on
  uint32_t table;         // the 16 code values' shared address
  DType dd;
  bool scale_after;
};

// S steps of a lane's columns in every row of its warp: the words of codes
// and scales of all S steps loaded before any is decoded (a loop over steps
// and rows that decoded each row's word before loading the next would keep
// one load in flight, the scale's branch keeping the compiler from hoisting
// the loads), their addresses stepped by NF4GemvCursor. The sums keep their
// order.
template <int S, class T, int MB, bool Staged>
__device__ inline void run_steps(const StepArgs& a, NF4GemvCursor (&at)[kRows], const T*& xl,
                                 T (&acc)[kRows][MB]) {
  uint32_t words[S][kRows];
  float scales[S][kRows];
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      words[s][r] = __ldg(reinterpret_cast<const uint32_t*>(at[r].codes));
      scales[s][r] = __ldg(reinterpret_cast<const float*>(at[r].scale));
      nf4_gemv_advance(at[r], a.steps);
    }
#pragma unroll
  for (int s = 0; s < S; ++s) {
    T wv[kRows][kCodes];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      decode_word(a.table, words[s][r], scales[s][r], a.dd, a.scale_after, wv[r]);
    accumulate8<T, MB>(
        wv, scales[s], a.scale_after,
        [&](int m, T(&xv)[kCodes]) {
          if constexpr (Staged)
            load8(xl + m * a.x_row, xv);
          else
            load8_global(xl + m * a.x_row, xv);
        },
        acc);
    xl += a.x_step;
  }
}

// MB: rows of x (1..kNF4GemvMaxBatch); R: codes per run (32 or 64), so
// that finding a column's run is a shift; Staged: x through shared memory
// in passes of `chunk` columns, else from global memory (chunk = K).
template <class T, int MB, int R, bool Staged>
__global__ void __launch_bounds__(kNF4GemvWarps* kWarp, nf4_gemv_min_blocks(sizeof(T), MB))
    gemv_kernel(const T* x, int64_t K, NF4Runs w, DType dd, int64_t N, const T* bias, T* y,
                int64_t chunk) {
  extern __shared__ __align__(16) unsigned char staged[];
  T* xs = reinterpret_cast<T*>(staged);        // [MB][slot(chunk)]: columns [c0, c0 + chunk)
  __shared__ __align__(256) float values[16];  // code_value: its low address byte 0
  constexpr int64_t E = sizeof(T);
  const int64_t row_slots = nf4_gemv_slot(chunk, E);
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  if (threadIdx.x < 16) values[threadIdx.x] = fn::nf4_value(static_cast<int>(threadIdx.x));
  const auto table = static_cast<uint32_t>(__cvta_generic_to_shared(values));
  // With f32 values and f32 sums the scale is applied once per word, to the
  // sum of value x x (the tiled path's rounding of value * scale to f32 is
  // then skipped: a last-bit difference per product, like a change of
  // summation order). f64 sums and 16-bit dequant dtypes round every
  // value * scale first, as the tiled path does, since that rounding is
  // larger than their sums' error.
  const bool scale_after = sizeof(T) == 4 && dd == DType::f32;
  const int64_t runs_per_row = K / R;
  const NF4GemvSteps steps = nf4_gemv_steps(w, R);
  // A lane's x: row m's values at xl + m * x_row, a step x_step further on.
  const int64_t x_row = Staged ? row_slots : K;
  const int64_t x_step = Staged ? nf4_gemv_slot(kNF4GemvStep, E) : kNF4GemvStep;

  for (int64_t n0 = static_cast<int64_t>(blockIdx.x) * kNF4GemvBlockRows; n0 < N;
       n0 += static_cast<int64_t>(gridDim.x) * kNF4GemvBlockRows) {
    int64_t row[kRows];
    warp_rows(n0, warp, N, row);
    T acc[kRows][MB];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int m = 0; m < MB; ++m) acc[r][m] = T(0);

    for (int64_t c0 = 0; c0 < K; c0 += chunk) {
      const int64_t len = chunk < K - c0 ? chunk : K - c0;
      __syncthreads();  // the last pass has read xs (and `values` is written)
      if constexpr (Staged) {
#pragma unroll
        for (int m = 0; m < MB; ++m)
          for (int64_t k = threadIdx.x; k < len; k += blockDim.x)
            xs[m * row_slots + nf4_gemv_slot(k, E)] = x[m * K + c0 + k];
        __syncthreads();
      }
      // len is whole runs (K % R == 0, chunk % 256 == 0), so a lane's word
      // never leaves its run or its row. Steps go in whole groups of
      // kStepsInFlight, their bound checked once a group, then one at a
      // time.
      NF4GemvCursor at[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        at[r] = nf4_gemv_cursor(w, R, row[r], runs_per_row, c0 + kCodes * lane);
      const T* xl = Staged ? xs + nf4_gemv_slot(kCodes * lane, E) : x + c0 + kCodes * lane;
      const StepArgs a{steps, x_row, x_step, table, dd, scale_after};
      int64_t k0 = kCodes * lane;
      for (; k0 + (kStepsInFlight - 1) * kNF4GemvStep < len; k0 += kStepsInFlight * kNF4GemvStep)
        run_steps<kStepsInFlight, T, MB, Staged>(a, at, xl, acc);
      for (; k0 < len; k0 += kNF4GemvStep) run_steps<1, T, MB, Staged>(a, at, xl, acc);
    }
    write_rows<T, MB>(acc, n0, warp, lane, N, bias, y);
  }
}

// Row values v of a word scaled by `scale` and rounded to DD (bf16, f16),
// two at a time: one packing conversion (F2FP) a pair, where rounding each
// alone is a conversion (F2F) each, at 16 a clock per multiprocessor in
// CUDA's throughput table, an eighth of f32 multiplies'. The same bits:
// both round to nearest even.
template <DType DD>
__device__ inline void scale_round(float scale, float (&v)[kCodes]) {
#pragma unroll
  for (int j = 0; j < kCodes; j += 2) {
    const float a = unfused_mul(v[j], scale), b = unfused_mul(v[j + 1], scale);
    if constexpr (DD == DType::bf16) {
      const __nv_bfloat162 p = __floats2bfloat162_rn(a, b);
      v[j] = __low2float(p), v[j + 1] = __high2float(p);
    } else {
      static_assert(DD == DType::f16, "bf16 or f16 values are rounded");
      const __half2 p = __floats2half2_rn(a, b);
      v[j] = __low2float(p), v[j + 1] = __high2float(p);
    }
  }
}

// The `fixed` kernel (plans.h: NF4GemvKind): one f32 row of x, the walk's
// step strides and the dequant dtype (DD) compile-time constants. A lane's addresses in a group of
// steps are its cursor plus constants (no address sums per load, no carry between runs), and its
// sums are the unstaged kernel's, in its order: the dot of 8 values and 8 x from 0, then the scaled
// dot (DD f32) or the dot of values already scaled and rounded added to the row's sum.
template <NF4GemvWalk Walk, DType DD>
__global__ void __launch_bounds__(kNF4GemvWarps* kWarp, nf4_gemv_min_blocks(4, 1))
    fixed_kernel(const float* x, int64_t K, NF4Runs w, int64_t N, const float* bias, float* y) {
  constexpr NF4GemvFixedSteps kStep = nf4_gemv_fixed_steps(Walk);
  static_assert(kStep.code_bytes > 0 && kStep.scale_bytes > 0, "a walk with constant steps");
  __shared__ __align__(256) float values[16];  // code_value: its low address byte 0
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  if (threadIdx.x < 16) values[threadIdx.x] = fn::nf4_value(static_cast<int>(threadIdx.x));
  __syncthreads();
  const auto table = static_cast<uint32_t>(__cvta_generic_to_shared(values));
  const int64_t runs_per_row = K / w.run;

  for (int64_t n0 = static_cast<int64_t>(blockIdx.x) * kNF4GemvBlockRows; n0 < N;
       n0 += static_cast<int64_t>(gridDim.x) * kNF4GemvBlockRows) {
    const uint8_t* codes[kRows];
    const uint8_t* scales[kRows];
    float acc[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t n = n0 + warp * kRows + r;  // past N: row N - 1, never written
      const NF4GemvCursor c =
          nf4_gemv_cursor(w, w.run, n < N ? n : N - 1, runs_per_row, kCodes * lane);
      codes[r] = c.codes, scales[r] = c.scale, acc[r] = 0.0f;
    }
    const float* xl = x + kCodes * lane;
    // One group: S steps' words and scales of every row loaded, then each
    // step's x (through L1) and its decoded rows summed.
    const auto group = [&]<int S>() {
      uint32_t words[S][kRows];
      float scale[S][kRows];
#pragma unroll
      for (int s = 0; s < S; ++s)
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          words[s][r] = __ldg(reinterpret_cast<const uint32_t*>(codes[r] + s * kStep.code_bytes));
          scale[s][r] = __ldg(reinterpret_cast<const float*>(scales[r] + s * kStep.scale_bytes));
        }
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        codes[r] += S * kStep.code_bytes, scales[r] += S * kStep.scale_bytes;
#pragma unroll
      for (int s = 0; s < S; ++s) {
        float xv[kCodes];
        load8_global(xl + s * kNF4GemvStep, xv);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const fn::NF4WordOffsets o = fn::nf4_word_offsets(words[s][r]);
          float v[kCodes];
#pragma unroll
          for (int j = 0; j < kCodes; ++j) v[j] = code_value(table, o, j);
          if constexpr (DD != DType::f32) scale_round<DD>(scale[s][r], v);
          float dot = 0.0f;
#pragma unroll
          for (int j = 0; j < kCodes; ++j) dot += v[j] * xv[j];
          acc[r] += DD == DType::f32 ? unfused_mul(scale[s][r], dot) : dot;
        }
      }
      xl += S * kNF4GemvStep;
    };
    int64_t k0 = kCodes * lane;
    for (; k0 + (kStepsInFlight - 1) * kNF4GemvStep < K; k0 += kStepsInFlight * kNF4GemvStep)
      group.template operator()<kStepsInFlight>();
    for (; k0 < K; k0 += kNF4GemvStep) group.template operator()<1>();
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t n = n0 + warp * kRows + r;
      const float sum = warp_sum(acc[r]);
      if (lane == 0 && n < N) y[n] = bias ? sum + bias[n] : sum;
    }
  }
}

template <NF4GemvWalk Walk>
void launch_fixed_walk(const float* x, int64_t K, const NF4Runs& w, DType dd, int64_t N,
                       const float* bias, float* y, unsigned blocks) {
  constexpr unsigned threads = kNF4GemvWarps * kWarp;
  if (dd == DType::bf16)
    fixed_kernel<Walk, DType::bf16><<<blocks, threads, 0, cuda::stream()>>>(x, K, w, N, bias, y);
  else if (dd == DType::f16)
    fixed_kernel<Walk, DType::f16><<<blocks, threads, 0, cuda::stream()>>>(x, K, w, N, bias, y);
  else
    fixed_kernel<Walk, DType::f32><<<blocks, threads, 0, cuda::stream()>>>(x, K, w, N, bias, y);
  QUANTA_CUDA_CHECK_LAUNCH();
}

void launch_fixed(const float* x, int64_t K, const NF4Runs& w, NF4GemvWalk walk, DType dd,
                  int64_t N, const float* bias, float* y, const NF4GemvPlan& p) {
  const auto blocks = static_cast<unsigned>(p.blocks);
  switch (walk) {
    case NF4GemvWalk::units:
      return launch_fixed_walk<NF4GemvWalk::units>(x, K, w, dd, N, bias, y, blocks);
    case NF4GemvWalk::packed32:
      return launch_fixed_walk<NF4GemvWalk::packed32>(x, K, w, dd, N, bias, y, blocks);
    case NF4GemvWalk::packed64:
      return launch_fixed_walk<NF4GemvWalk::packed64>(x, K, w, dd, N, bias, y, blocks);
    case NF4GemvWalk::packed128:
      return launch_fixed_walk<NF4GemvWalk::packed128>(x, K, w, dd, N, bias, y, blocks);
    case NF4GemvWalk::packed256:
      return launch_fixed_walk<NF4GemvWalk::packed256>(x, K, w, dd, N, bias, y, blocks);
    case NF4GemvWalk::none:
      break;
  }
  throw std::logic_error("nf4_gemv: the fixed kernel needs a walk (plans.h: nf4_gemv_kind_for)");
}

template <class T, int MB, int R>
void launch(const T* x, int64_t K, const NF4Runs& w, DType dd, int64_t N, const T* bias, T* y,
            const NF4GemvPlan& p) {
  const auto blocks = static_cast<unsigned>(p.blocks);
  if (p.kind == NF4GemvKind::unstaged)
    gemv_kernel<T, MB, R, false>
        <<<blocks, kNF4GemvWarps * kWarp, 0, cuda::stream()>>>(x, K, w, dd, N, bias, y, K);
  else
    gemv_kernel<T, MB, R, true>
        <<<blocks, kNF4GemvWarps * kWarp, static_cast<size_t>(p.smem_bytes), cuda::stream()>>>(
            x, K, w, dd, N, bias, y, p.chunk);
  QUANTA_CUDA_CHECK_LAUNCH();
}

// The kernel for M rows of x: one instantiation per batch size, so the
// accumulators are registers.
template <class T, int R, int MB = 1>
void launch_rows(int64_t M, const T* x, int64_t K, const NF4Runs& w, DType dd, int64_t N,
                 const T* bias, T* y, const NF4GemvPlan& p) {
  if constexpr (MB < kNF4GemvMaxBatch) {
    if (M != MB) return launch_rows<T, R, MB + 1>(M, x, K, w, dd, N, bias, y, p);
  }
  launch<T, MB, R>(x, K, w, dd, N, bias, y, p);
}

}  // namespace

template <class T>
void nf4_gemv(const T* x, int64_t M, int64_t K, const NF4Runs& w, DType dd, int64_t N,
              const T* bias, T* y) {
  const NF4GemvWalk walk = nf4_gemv_walk(w);
  const NF4GemvKind kind =
      nf4_gemv_kind_for(nf4_gemv_kind_from(std::getenv("QUANTA_NF4_GEMV"), M), M, sizeof(T), walk,
                        reinterpret_cast<uintptr_t>(x) % 16 == 0);
  const NF4GemvPlan p = nf4_gemv_plan(M, K, N, sizeof(T), kind);
  if (p.blocks == 0) return;
  if constexpr (std::is_same_v<T, float>) {
    if (kind == NF4GemvKind::fixed) return launch_fixed(x, K, w, walk, dd, N, bias, y, p);
  }
  if (w.run == 32)
    launch_rows<T, 32>(M, x, K, w, dd, N, bias, y, p);
  else
    launch_rows<T, 64>(M, x, K, w, dd, N, bias, y, p);
}

template void nf4_gemv<float>(const float*, int64_t, int64_t, const NF4Runs&, DType, int64_t,
                              const float*, float*);
template void nf4_gemv<double>(const double*, int64_t, int64_t, const NF4Runs&, DType, int64_t,
                               const double*, double*);

}  // namespace quanta::quant::quant_cuda
