#pragma once
// SIMD decoding and encoding of packed NF4 codes (internal to quant/cpu): a
// table lookup of the 16 values by the nibbles of 4 or 8 packed bytes, high
// nibble first, over runs of 32 or 64 elements (a block-32 run or a 64-element
// unit of the nf4 dtype).
#include <array>
#include <cstdint>
#include <cstring>

#include "engine/dtype.h"
#include "quant/kernels/nf4_layout.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace quanta::quant::simd {

#if defined(__AVX512F__)
// The 16 NF4 values of the 16 codes in the 16 nibbles of `eight` (high nibble
// of byte 0 first), through one 16-lane table lookup.
inline __m512 decode16(uint64_t eight, __m512 values) {
  const __m512i shifts =
      _mm512_setr_epi32(4, 0, 12, 8, 20, 16, 28, 24, 4, 0, 12, 8, 20, 16, 28, 24);
  const __m512i words = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_set1_epi32(static_cast<int>(eight & 0xFFFFFFFFu))),
      _mm256_set1_epi32(static_cast<int>(eight >> 32)), 1);
  const __m512i idx = _mm512_and_si512(_mm512_srlv_epi32(words, shifts), _mm512_set1_epi32(15));
  return _mm512_permutexvar_ps(idx, values);
}

// v rounded to `dtype` (f32: unchanged; bf16 and f16: to nearest even) and
// widened back to f32, lane by lane.
inline __m512 round_to(__m512 v, DType dtype) {
  if (dtype == DType::bf16) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    return _mm512_castsi512_ps(
        _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  if (dtype == DType::f16)
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return v;
}

/** The 16 dequantized values dtype(float32(value * scale)) as f32 lanes. */
inline __m512 scaled_values(float scale, DType dtype) {
  return round_to(_mm512_mul_ps(_mm512_loadu_ps(kNF4Values.data()), _mm512_set1_ps(scale)), dtype);
}
#endif

#if defined(__AVX2__)
// The 8 NF4 values of the 8 codes in the 8 nibbles of `four`: two 8-lane
// table lookups blended on the code's top bit.
inline __m256 decode8(uint32_t four, __m256 lo_vals, __m256 hi_vals) {
  const __m256i shifts = _mm256_setr_epi32(4, 0, 12, 8, 20, 16, 28, 24);
  const __m256i idx = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(four)), shifts), _mm256_set1_epi32(15));
  const __m256 a = _mm256_permutevar8x32_ps(lo_vals, idx);
  const __m256 b = _mm256_permutevar8x32_ps(hi_vals, idx);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}
#endif

/** The 16 dequantized values dtype(float32(value * scale)), widened to f32
 * (f32: the f32 products; bf16, f16: rounded to nearest even). */
inline std::array<float, 16> scaled_table(float scale, DType dtype) {
  std::array<float, 16> t{};
  for (int c = 0; c < 16; ++c) {
    const float v = kNF4Values[c] * scale;
    t[c] = dtype == DType::bf16  ? static_cast<float>(bf16(v))
           : dtype == DType::f16 ? static_cast<float>(f16(v))
                                 : v;
  }
  return t;
}

#if defined(__AVX512F__)
/** Packs the codes of R (32 or 64) scaled values (the number of `mids`
 * strictly below each; NaN gives 0) into R / 2 bytes, high nibble = even
 * element. */
template <int R>
inline void encode_run(const float* scaled, const std::array<float, 15>& mids, uint8_t* dst) {
  static_assert(R % 16 == 0);
  alignas(64) float t[16];
  for (int i = 0; i < 15; ++i) t[i] = mids[i];
  t[15] = __builtin_inff();
  const __m512 table = _mm512_load_ps(t);
  for (int q = 0; q < R / 16; ++q) {
    const __m512 v = _mm512_loadu_ps(scaled + 16 * q);
    // Branch-free binary search: idx = number of midpoints below v.
    __m512i idx = _mm512_setzero_si512();
    for (int step : {8, 4, 2, 1}) {
      const __m512 m =
          _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(step - 1)), table);
      const __mmask16 above = _mm512_cmp_ps_mask(v, m, _CMP_GT_OQ);
      idx = _mm512_mask_add_epi32(idx, above, idx, _mm512_set1_epi32(step));
    }
    const __m128i c = _mm512_cvtepi32_epi8(idx);  // 16 codes, one per byte
    // 16-bit lane j holds c[2j] (low byte) and c[2j+1] (high byte).
    const __m128i hi = _mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x000F)), 4);
    const __m128i lo = _mm_srli_epi16(c, 8);
    const __m128i bytes = _mm_or_si128(hi, lo);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + 8 * q), _mm_packus_epi16(bytes, bytes));
  }
}
#define QUANTA_NF4_ENCODE_SIMD 1
#endif

/** The R (32 or 64) values of one full run: float32(value(code) * scale)
 * rounded to `dtype` (f32, bf16 or f16) and widened back to f32. */
template <int R>
inline void decode_run_f32(const uint8_t* codes, float scale, DType dtype, float* dst) {
  static_assert(R % 16 == 0);
#if defined(__AVX512F__)
  const __m512 lut = scaled_values(scale, dtype);
  for (int g = 0; g < R / 16; ++g) {
    uint64_t eight;
    std::memcpy(&eight, codes + 8 * g, 8);
    _mm512_storeu_ps(dst + 16 * g, decode16(eight, lut));
  }
#elif defined(__AVX2__)
  const std::array<float, 16> t = scaled_table(scale, dtype);
  const __m256 lo = _mm256_loadu_ps(t.data());
  const __m256 hi = _mm256_loadu_ps(t.data() + 8);
  for (int g = 0; g < R / 8; ++g) {
    uint32_t four;
    std::memcpy(&four, codes + 4 * g, 4);
    _mm256_storeu_ps(dst + 8 * g, decode8(four, lo, hi));
  }
#else
  const std::array<float, 16> lut = scaled_table(scale, dtype);
  for (int j = 0; j < R / 2; ++j) {
    dst[2 * j] = lut[codes[j] >> 4];
    dst[2 * j + 1] = lut[codes[j] & 15];
  }
#endif
}

}  // namespace quanta::quant::simd
