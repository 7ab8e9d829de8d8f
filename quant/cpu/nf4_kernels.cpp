// CPU entries nf4_absmax, nf4_encode and nf4_decode (quant/kernels/table.h):
// the NF4 format's block scales, codes and dequantized values, bit for bit
// as bitsandbytes' reference backend (docs/nf4.md). Scaling and codes are
// quant/kernels/functors.h's, which the CUDA kernels share.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "engine/cpu/gemm_bf16.h"
#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"
#include "quant/cpu/kernels.h"
#include "quant/cpu/nf4_simd.h"
#include "quant/kernels/functors.h"

namespace quanta::quant::quant_cpu {
namespace {

// Elements of work for the parallel loops: big enough to amortise a task.
constexpr int64_t kElemsPerTask = 512 * kNF4UnitElems;

// Codes of R scaled values packed into R / 2 bytes. `scaled` holds R values;
// entries past the run's length are 0, which is code 7 (the padding).
template <int R>
void pack_run(const float* scaled, uint8_t* dst) {
#ifdef QUANTA_NF4_ENCODE_SIMD
  simd::encode_run<R>(scaled, nf4_midpoints(), dst);
#else
  // Each code counts the midpoints below its value, as the CUDA kernel does.
  for (int j = 0; j < R / 2; ++j)
    dst[j] =
        static_cast<uint8_t>((fn::nf4_code(scaled[2 * j]) << 4) | fn::nf4_code(scaled[2 * j + 1]));
#endif
}

template <int R>
void encode_runs(const float* px, int64_t n, int64_t bs, const float* absmax, const float* stored,
                 const NF4RunsOut& out) {
  const int64_t blocks = (n + bs - 1) / bs;
  cpu::parallel_for(0, blocks, std::max<int64_t>(1, kElemsPerTask / bs),
                    [&](int64_t lo, int64_t hi) {
                      float scaled[R];
                      uint8_t packed[R / 2];
                      for (int64_t b = lo; b < hi; ++b) {
                        const int64_t begin = b * bs, len = std::min(bs, n - begin);
                        const float a = fn::nf4_block_scale(absmax[static_cast<size_t>(b)]);
                        const float inv = 1.0f / a;
                        const bool full = len == bs;
                        for (int64_t r0 = 0; r0 < len; r0 += R) {
                          const int64_t rlen = std::min<int64_t>(R, len - r0);
                          const float* p = px + begin + r0;
                          // bitsandbytes' reference backend multiplies full blocks by the
                          // reciprocal and divides the partial last block; both are kept so
                          // codes match bit for bit.
                          if (full) {
                            for (int64_t i = 0; i < rlen; ++i)
                              scaled[i] = fn::nf4_scaled(p[i], a, inv, true);
                          } else {
                            for (int64_t i = 0; i < rlen; ++i)
                              scaled[i] = fn::nf4_scaled(p[i], a, inv, false);
                          }
                          for (int64_t i = rlen; i < R; ++i) scaled[i] = 0.0f;
                          const int64_t r = (begin + r0) / R;
                          uint8_t* dst = out.codes + r * out.code_stride;
                          if (rlen == R || out.pad_runs) {
                            pack_run<R>(scaled, dst);
                          } else {
                            pack_run<R>(scaled, packed);
                            std::memcpy(dst, packed, static_cast<size_t>((rlen + 1) / 2));
                          }
                          if (out.scales) {
                            const float s = stored[static_cast<size_t>(b)];
                            std::memcpy(out.scales + r * out.scale_stride, &s, sizeof s);
                          }
                        }
                      }
                    });
}

// Every element of `w` as T (float, bf16 or f16): T(value * scale).
template <class T, int R>
void decode_all_runs(const NF4Runs& w, T* po) {
  const int64_t n = w.n;
  cpu::parallel_for(0, w.runs(), std::max<int64_t>(1, kElemsPerTask / R),
                    [&](int64_t lo, int64_t hi) {
                      T lut[16];
                      T tmp[R];
                      for (int64_t r = lo; r < hi; ++r) {
                        const uint8_t* codes = w.codes_of(r);
                        const float s = w.scale_of(r);
                        const int64_t begin = r * R;
                        const int64_t len = std::min<int64_t>(R, n - begin);
                        if constexpr (std::is_same_v<T, float>) {
                          if (len == R) {
                            simd::decode_run_f32<R>(codes, s, DType::f32, po + begin);
                            continue;
                          }
                        }
                        // One float32 product per code, then one rounding to T: exactly
                        // bitsandbytes' T(code * absmax).
                        for (int c = 0; c < 16; ++c) lut[c] = T(kNF4Values[c] * s);
                        T* dst = len == R ? po + begin : tmp;
                        for (int64_t j = 0; j < (len + 1) / 2; ++j) {
                          dst[2 * j] = lut[codes[j] >> 4];
                          if (2 * j + 1 < R) dst[2 * j + 1] = lut[codes[j] & 15];
                        }
                        if (dst == tmp) std::copy(tmp, tmp + len, po + begin);
                      }
                    });
}

template <class T, int R>
void decode_range_runs(const NF4Runs& w, int64_t begin, int64_t count, DType dtype, T* out) {
  const int64_t end = begin + count;
  int64_t i = begin;
  while (i < end) {
    const int64_t r = i / R;
    const uint8_t* codes = w.codes_of(r);
    const float s = w.scale_of(r);
    const int64_t stop = std::min(end, (r + 1) * R);
    if (i == r * R && stop == i + R) {
      T* dst = out + (i - begin);
      if constexpr (std::is_same_v<T, float>) {
        simd::decode_run_f32<R>(codes, s, dtype, dst);
        i = stop;
        continue;
      }
      if constexpr (std::is_same_v<T, bf16>) {
        // Decoded values are bf16 already (dtype bf16): the rounding is exact.
        if (dtype == DType::bf16) {
          float run[R];
          simd::decode_run_f32<R>(codes, s, dtype, run);
          cpu::round_to_bf16(run, R, dst);
          i = stop;
          continue;
        }
      }
    }
    const std::array<float, 16> t = simd::scaled_table(s, dtype);
    T lut[16];
    for (int c = 0; c < 16; ++c) lut[c] = static_cast<T>(t[c]);
    for (; i < stop; ++i) {
      const int64_t k = i - r * R;
      const uint8_t byte = codes[k / 2];
      out[i - begin] = lut[k % 2 == 0 ? byte >> 4 : byte & 15];
    }
  }
}

}  // namespace

template <class T>
void nf4_decode_range(const NF4Runs& w, int64_t begin, int64_t count, DType dtype, T* out) {
  if (begin < 0 || count < 0 || begin + count > w.n)
    throw std::invalid_argument("[nf4 decode] range [" + std::to_string(begin) + ", " +
                                std::to_string(begin + count) + ") outside " + std::to_string(w.n) +
                                " elements");
  if (w.run == 32)
    decode_range_runs<T, 32>(w, begin, count, dtype, out);
  else
    decode_range_runs<T, 64>(w, begin, count, dtype, out);
}

template void nf4_decode_range<float>(const NF4Runs&, int64_t, int64_t, DType, float*);
template void nf4_decode_range<double>(const NF4Runs&, int64_t, int64_t, DType, double*);
template void nf4_decode_range<bf16>(const NF4Runs&, int64_t, int64_t, DType, bf16*);

void nf4_decode(const NF4Runs& w, DType dtype, void* out) {
  if (w.n == 0) return;
  dispatch_all(dtype, "dequantize", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, f16>) {
      if (w.run == 32)
        decode_all_runs<T, 32>(w, static_cast<T*>(out));
      else
        decode_all_runs<T, 64>(w, static_cast<T*>(out));
    }
  });
}

void nf4_absmax(const float* px, int64_t n, int64_t bs, float* absmax) {
  const int64_t blocks = (n + bs - 1) / bs;
  cpu::parallel_for(0, blocks, std::max<int64_t>(1, kElemsPerTask / bs),
                    [&](int64_t lo, int64_t hi) {
                      for (int64_t b = lo; b < hi; ++b) {
                        const float* p = px + b * bs;
                        const int64_t len = std::min(bs, n - b * bs);
                        // Sixteen running maxima (each in element order) vectorise; NaN is
                        // ignored as std::max(a, NaN) ignores it.
                        float lanes[16] = {};
                        int64_t i = 0;
                        for (; i + 16 <= len; i += 16)
                          for (int l = 0; l < 16; ++l)
                            lanes[l] = fn::nf4_absmax_step(lanes[l], p[i + l]);
                        float a = 0;
                        for (; i < len; ++i) a = fn::nf4_absmax_step(a, p[i]);
                        for (float l : lanes) a = fn::max_of(a, l);
                        absmax[static_cast<size_t>(b)] = a;
                      }
                    });
}

void nf4_encode(const float* x, int64_t n, int64_t block, const float* absmax, const float* stored,
                const NF4RunsOut& out) {
  if ((out.run != 32 && out.run != 64) || block % out.run != 0)
    throw std::logic_error("[nf4 encode] block " + std::to_string(block) +
                           " is not whole runs of " + std::to_string(out.run));
  if (out.run == 32)
    encode_runs<32>(x, n, block, absmax, stored, out);
  else
    encode_runs<64>(x, n, block, absmax, stored, out);
}

}  // namespace quanta::quant::quant_cpu
