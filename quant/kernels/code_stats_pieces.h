#pragma once
// The piece walk of code_statistics on CUDA (quant/cuda/code_statistics.cu),
// written once for nvcc and g++ so that the CPU tests run the same logic on
// a std::stable_sort of the keys. The rows are sorted by code; the sorted
// order is cut into pieces of P rows. Walking piece j for one column, each
// code's part of the piece is summed in row order and goes to
//   head[j]  when the code began in an earlier piece (also when it fills the
//            piece and goes on),
//   tail[j]  when it began in this piece and goes on into the next,
//   sums[c]  when all of the code's rows are in this piece.
// combine_code then finishes each code that spans pieces ps..pe as
// tail[ps] + head[ps + 1] + ... + head[pe], in that order. Every addition's
// order follows from the keys alone: the same bits on every run.
#include <cstdint>

#include "engine/kernels/functors.h"         // QUANTA_HD
#include "engine/kernels/reduce_functors.h"  // fold_strided

namespace quanta::quant::fn {

/** Where a code's part of a piece goes. */
enum class PiecePart { whole, head, tail };

/** Values of x a piece walk reads before it adds any of them (a spanning
 * code's combine reads ahead through fold_strided). A thread per column walks its rows one after
 * another, and a walk that writes a code's sum as it goes leaves each load waiting on the last (a
 * load cannot move above a store that might alias it): one load in flight per thread, which on a
 * GPU is a DRAM round trip per row. Reading a batch first keeps kPieceLoads of them in flight; the
 * additions keep their order, so the sums' bits do not change. */
inline constexpr int kPieceLoads = 8;

/** Column e of a piece of `len` sorted rows: keys[t] their codes (k and up
 * are not counted), rows[t] their row numbers in x [n, d]; from_before:
 * the piece's first code began in an earlier piece; into_next: its last
 * code goes on into the next. Calls put(part, code, sum) once per counted
 * code of the piece; each sum adds its rows in sorted order. */
template <class T, class Put>
QUANTA_HD void walk_piece(const int32_t* keys, const int32_t* rows, int64_t len, bool from_before,
                          bool into_next, const T* x, int64_t d, int64_t e, int64_t k, Put&& put) {
  const auto emit = [&](int32_t code, T acc, bool first, bool last) {
    if (code >= k) return;
    if (first && from_before)
      put(PiecePart::head, code, acc);
    else if (last && into_next)
      put(PiecePart::tail, code, acc);
    else
      put(PiecePart::whole, code, acc);
  };
  int32_t code = keys[0];
  bool first = true;
  T acc = T(0);
  for (int64_t t0 = 0; t0 < len; t0 += kPieceLoads) {
    const int64_t batch = len - t0 < kPieceLoads ? len - t0 : kPieceLoads;
    T v[kPieceLoads];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int u = 0; u < kPieceLoads; ++u)
      v[u] = u < batch ? x[static_cast<int64_t>(rows[t0 + u]) * d + e] : T(0);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int u = 0; u < kPieceLoads; ++u) {
      if (u >= batch) break;
      if (keys[t0 + u] != code) {
        emit(code, acc, first, false);
        code = keys[t0 + u];
        first = false;
        acc = T(0);
      }
      acc += v[u];
    }
  }
  emit(code, acc, first, true);
}

/** Whether the code whose sorted rows are [s, end) (pieces of P rows) spans
 * more than one piece, so that combine_code must finish it. */
QUANTA_HD inline bool spans_pieces(int64_t s, int64_t end, int64_t P) {
  return end > s && s / P != (end - 1) / P;
}

/** Column e of a spanning code's sum: its tail in its first piece plus its
 * heads in the later ones, in piece order (head, tail: [pieces, d]). */
template <class T>
QUANTA_HD T combine_code(int64_t s, int64_t end, int64_t P, const T* head, const T* tail, int64_t d,
                         int64_t e) {
  const int64_t ps = s / P, pe = (end - 1) / P;
  // The heads of pieces ps + 1 .. pe, a column d apart, read ahead in order.
  return quanta::fn::fold_strided(tail[ps * d + e], head + (ps + 1) * d + e, pe - ps, d,
                                  quanta::fn::FoldSum{});
}

}  // namespace quanta::quant::fn
