#pragma once
// The index of a row's smallest score (internal to quant/cpu): what the
// nearest-code search does to every row of its distance tile. Every form
// returns the same index: the first of the smallest on ties (-0 and +0
// tie), never a NaN (a row of only NaN, or only +inf, gives 0).
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace quanta::quant::quant_cpu {

/** The portable form, for every T: kLanes running minima with their indices
 * (a strict < keeps each lane's first), then the lanes' minimum, the
 * smallest index among equal ones. Written as lane arrays so that the
 * compiler may turn the inner loop into vector compares and blends. */
template <class T>
int64_t row_argmin_lanes(const T* row, int64_t k) {
  constexpr int kLanes = 64 / sizeof(T);
  T best[kLanes];
  int64_t at[kLanes];
  for (int l = 0; l < kLanes; ++l) best[l] = std::numeric_limits<T>::infinity(), at[l] = 0;
  int64_t j = 0;
  for (; j + kLanes <= k; j += kLanes)
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const T v = row[j + l];
      const bool lower = v < best[l];
      best[l] = lower ? v : best[l];
      at[l] = lower ? j + l : at[l];
    }
  T m = std::numeric_limits<T>::infinity();
  int64_t idx = 0;
  for (; j < k; ++j)  // the tail, in order
    if (row[j] < m) m = row[j], idx = j;
  for (int l = 0; l < kLanes; ++l)
    if (best[l] < m || (best[l] == m && at[l] < idx)) m = best[l], idx = at[l];
  return idx;
}

#if defined(__AVX512F__)
/** f32 on AVX-512: two vectors of 16 running minima with their indices,
 * kept in registers by mask compares and masked moves (GCC's code for the
 * lane arrays spilled them and branched on every vector: 70% of the VQ
 * search's time). The tail loads +inf past the row's end, which never wins. */
inline int64_t row_argmin_avx512(const float* row, int64_t k) {
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 best0 = inf, best1 = inf;
  __m512i at0 = _mm512_setzero_si512(), at1 = _mm512_setzero_si512();
  __m512i idx0 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i idx1 = _mm512_add_epi32(idx0, _mm512_set1_epi32(16));
  const __m512i step = _mm512_set1_epi32(32);
  int64_t j = 0;
  for (; j + 32 <= k; j += 32) {
    const __m512 v0 = _mm512_loadu_ps(row + j), v1 = _mm512_loadu_ps(row + j + 16);
    const __mmask16 lower0 = _mm512_cmp_ps_mask(v0, best0, _CMP_LT_OQ);
    const __mmask16 lower1 = _mm512_cmp_ps_mask(v1, best1, _CMP_LT_OQ);
    best0 = _mm512_mask_mov_ps(best0, lower0, v0);
    best1 = _mm512_mask_mov_ps(best1, lower1, v1);
    at0 = _mm512_mask_mov_epi32(at0, lower0, idx0);
    at1 = _mm512_mask_mov_epi32(at1, lower1, idx1);
    idx0 = _mm512_add_epi32(idx0, step);
    idx1 = _mm512_add_epi32(idx1, step);
  }
  for (; j < k; j += 16) {  // at most two partial vectors
    const int64_t left = k - j;
    const __mmask16 in = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512 v = _mm512_mask_loadu_ps(inf, in, row + j);
    const __mmask16 lower = _mm512_cmp_ps_mask(v, best0, _CMP_LT_OQ);
    best0 = _mm512_mask_mov_ps(best0, lower, v);
    at0 = _mm512_mask_mov_epi32(at0, lower, idx0);
    idx0 = _mm512_add_epi32(idx0, _mm512_set1_epi32(16));
  }
  // Lane by lane, the earlier of the two vectors' candidates on a tie; then
  // the smallest value, and the smallest index holding it.
  const __mmask16 take1 = _mm512_cmp_ps_mask(best1, best0, _CMP_LT_OQ) |
                          (_mm512_cmp_ps_mask(best1, best0, _CMP_EQ_OQ) &
                           _mm512_cmp_epi32_mask(at1, at0, _MM_CMPINT_LT));
  const __m512 best = _mm512_mask_mov_ps(best0, take1, best1);
  const __m512i at = _mm512_mask_mov_epi32(at0, take1, at1);
  const float m = _mm512_reduce_min_ps(best);
  const __mmask16 holds = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(holds, at);
}
#endif

/** The row's argmin by the fastest form this build has for T. */
template <class T>
int64_t row_argmin(const T* row, int64_t k) {
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4) {
    if (k < (int64_t(1) << 31) - 32) return row_argmin_avx512(row, k);
  }
#endif
  return row_argmin_lanes(row, k);
}

}  // namespace quanta::quant::quant_cpu
