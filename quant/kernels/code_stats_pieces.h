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

#include "engine/kernels/functors.h"  // QUANTA_HD

namespace quanta::quant::fn {

/** Where a code's part of a piece goes. */
enum class PiecePart { whole, head, tail };

/** Column e of a piece of `len` sorted rows: keys[t] their codes (k and up
 * are not counted), rows[t] their row numbers in x [n, d]; from_before:
 * the piece's first code began in an earlier piece; into_next: its last
 * code goes on into the next. Calls put(part, code, sum) once per counted
 * code of the piece. */
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
  for (int64_t t = 0; t < len; ++t) {
    if (keys[t] != code) {
      emit(code, acc, first, false);
      code = keys[t];
      first = false;
      acc = T(0);
    }
    acc += x[static_cast<int64_t>(rows[t]) * d + e];
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
  T acc = tail[ps * d + e];
  for (int64_t j = ps + 1; j <= pe; ++j) acc += head[j * d + e];
  return acc;
}

}  // namespace quanta::quant::fn
