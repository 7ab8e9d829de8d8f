// dropout_product on the CPU: dropout and the rank-r product after it (LoRA's
// first factor) over blocks of rows held in cache, so the dropped copy of x
// is never written to memory and read back, nor is the backward's (g w):
// each block's keep-mask is drawn, applied and multiplied while it is in L2.
// With AVX-512 and f32, the block products are register-tiled kernels made
// for a narrow side of r (a generic GEMM's packing costs more than these
// products on blocks of a few dozen rows); f64 (tests, mostly) runs plain
// loops over the same blocks. Either way each sum runs in an order fixed by
// the shapes alone. f32 without AVX-512 takes the unfused steps.
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "engine/cpu/block_cache.h"
#include "engine/cpu/gemm.h"
#include "engine/cpu/keep_mask.h"
#include "engine/cpu/kernels.h"
#include "engine/cpu/parallel.h"
#include "engine/kernels/dropout_product_steps.h"
#include "engine/random/draw.h"

namespace quanta::cpu {
namespace {

// Rows per block: about 64K elements of x (256 KB in f32), a multiple of 8,
// so a block's words and dropped copy stay in L2 beside the factor.
int64_t block_rows(int64_t k) {
  const int64_t rows = std::clamp<int64_t>((int64_t{1} << 16) / k, 8, 64);
  return rows / 8 * 8;
}

// The rows of one block: its keep-mask as the stream's words (words[i] for
// element i of the block) or as kept bits (DropoutProduct::keep_bits' rows,
// keep_bit_words(k) words each), and xd its dropped copy of x.
template <class T>
struct Block {
  int64_t m0 = 0, rows = 0;
  const uint32_t* words = nullptr;
  const uint16_t* bits = nullptr;
  T* xd = nullptr;
};

template <class T>
void draw_block(const KeepMask<T>& mask, int64_t k, Block<T>& b, uint32_t* words) {
  mask.stream.words(b.m0 * k, (b.m0 + b.rows) * k, words);
  b.words = words;
}

// Whether element c of the block's row i is kept, from its bit.
inline bool kept_bit(const uint16_t* bits, int64_t bw, int64_t i, int64_t c) {
  return (bits[i * bw + c / 16] >> (c % 16)) & 1u;
}

// The block's words as kept bits into bits (keep_bits' layout).
void pack_bits(const uint32_t* words, int64_t rows, int64_t k, uint32_t cut, uint16_t* bits) {
  const int64_t bw = keep_bit_words(k);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t w = 0; w < bw; ++w) {
      const int64_t c0 = w * 16, n = std::min<int64_t>(16, k - c0);
      const uint32_t* row = words + i * k + c0;
#if defined(__AVX512F__)
      const auto in = static_cast<__mmask16>(n >= 16 ? 0xFFFFu : (1u << n) - 1u);
      bits[i * bw + w] = _mm512_mask_cmplt_epu32_mask(in, _mm512_maskz_loadu_epi32(in, row),
                                                      _mm512_set1_epi32(static_cast<int>(cut)));
#else
      uint16_t v = 0;
      for (int64_t j = 0; j < n; ++j) v |= static_cast<uint16_t>((row[j] < cut ? 1u : 0u) << j);
      bits[i * bw + w] = v;
#endif
    }
}

// xd = x * (kept or dropped) over the block's rows, from its bits.
template <class T>
void select_bits(const uint16_t* bits, int64_t rows, int64_t k, const T* x, T* xd, T kept,
                 T dropped) {
  const int64_t bw = keep_bit_words(k);
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const __m512 kv = _mm512_set1_ps(kept), dv = _mm512_set1_ps(dropped);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t w = 0; w < bw; ++w) {
        const int64_t c0 = w * 16, n = std::min<int64_t>(16, k - c0);
        const auto in = static_cast<__mmask16>(n >= 16 ? 0xFFFFu : (1u << n) - 1u);
        const __m512 m = _mm512_mask_blend_ps(bits[i * bw + w], dv, kv);
        const __m512 v = _mm512_maskz_loadu_ps(in, x + i * k + c0);
        _mm512_mask_storeu_ps(xd + i * k + c0, in, _mm512_mul_ps(v, m));
      }
    return;
  }
#endif
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < k; ++c)
      xd[i * k + c] = x[i * k + c] * (kept_bit(bits, bw, i, c) ? kept : dropped);
}

template <class T>
void drop_block(const KeepMask<T>& mask, const T* x, int64_t k, Block<T>& b, T* xd) {
  if (b.bits)
    select_bits(b.bits, b.rows, k, x + b.m0 * k, xd, mask.kept, mask.dropped);
  else
    select_words(b.words, x + b.m0 * k, xd, b.rows * k, mask.cut, mask.kept, mask.dropped);
  b.xd = xd;
}

// out[c] += a * x[c], c < n: unaliased, so it is one vector loop.
template <class T>
void axpy(int64_t n, T a, const T* __restrict x, T* __restrict out) {
  for (int64_t c = 0; c < n; ++c) out[c] += a * x[c];
}

// sum of x[c] y[c], c < n, in kLanes partial sums (the compiler makes them
// one vector) added in order, then the tail.
template <class T>
T dot(int64_t n, const T* __restrict x, const T* __restrict y) {
  constexpr int kLanes = 16;
  const int64_t whole = n / kLanes * kLanes;
  T lanes[kLanes] = {};
  for (int64_t c = 0; c < whole; c += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += x[c + l] * y[c + l];
  T sum = 0;
  for (int64_t c = whole; c < n; ++c) sum += x[c] * y[c];
  for (const T v : lanes) sum += v;
  return sum;
}

// The block products as loops over a contiguous inner dimension (any dtype,
// any CPU): every sum runs in one fixed order, which a GEMM library's
// blocking would not give (Eigen's depends on the thread count).
template <class T>
struct LoopProducts {
  static constexpr bool kReadsDroppedCopy = true;  // weight_grad reads b.xd
  const T* w;                                      // [r, k]
  int64_t k, r;

  // t[rows, r] = xd w^T
  void forward(const Block<T>& b, T* t) const {
    for (int64_t i = 0; i < b.rows; ++i)
      for (int64_t j = 0; j < r; ++j) t[i * r + j] = dot(k, b.xd + i * k, w + j * k);
  }
  // gw[r, k] (+)= gt_rows^T xd, the rows in order.
  void weight_grad(const Block<T>& b, const KeepMask<T>&, const T*, const T* gt, T* gw,
                   bool accumulate) const {
    if (!accumulate) std::fill(gw, gw + r * k, T(0));
    for (int64_t j = 0; j < r; ++j)
      for (int64_t i = 0; i < b.rows; ++i) axpy(k, gt[i * r + j], b.xd + i * k, gw + j * k);
  }
  // gx rows = (or +=) (gt_rows w) * keep; scratch holds rows * k values.
  void input_grad(const Block<T>& b, const T* gt, const KeepMask<T>& mask, T* scratch, T* gx,
                  bool accumulate) const {
    std::fill(scratch, scratch + b.rows * k, T(0));
    for (int64_t i = 0; i < b.rows; ++i)
      for (int64_t j = 0; j < r; ++j) axpy(k, gt[i * r + j], w + j * k, scratch + i * k);
    T* out = gx + b.m0 * k;
    const int64_t bw = keep_bit_words(k);
    for (int64_t i = 0; i < b.rows; ++i)
      for (int64_t c = 0; c < k; ++c) {
        const int64_t e = i * k + c;
        const bool kept = b.bits ? kept_bit(b.bits, bw, i, c) : b.words[e] < mask.cut;
        const T v = scratch[e] * (kept ? mask.kept : mask.dropped);
        out[e] = accumulate ? out[e] + v : v;
      }
  }
};

#if defined(__AVX512F__)
// Tiles with their row counts fixed at compile time, every loop over their
// registers unrolled: with a run-time count the compiler kept the
// accumulators in memory, a store per multiply-add.
inline __mmask16 first_lanes(int64_t n) {
  return static_cast<__mmask16>(n >= 16 ? 0xFFFFu : (1u << n) - 1u);
}

// t[N rows, 16 columns from j0] = x rows (row stride k) times wt's 16
// columns (row stride rp): each x value broadcast against a row of wt.
template <int N>
void forward_tile(const float* x, int64_t k, const float* wt, int64_t rp, __mmask16 cols, float* t,
                  int64_t ldt) {
  __m512 acc[N];
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; ++c) {
    const __m512 v = _mm512_loadu_ps(wt + c * rp);
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * k + c]), v, acc[i]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) _mm512_mask_storeu_ps(t + i * ldt, cols, acc[i]);
}

// gx[N rows, k] = (or +=) (g rows (stride rp) times w [r, k]) times the
// keep-mask of the words (row stride k), 16 columns at a time: per rank
// chunk, 16 rows of w in registers against the N rows of g.
template <int N>
void input_grad_tile(const float* g, int64_t rp, const float* w, int64_t k, int64_t r,
                     const uint32_t* words, const uint16_t* bits, const KeepMask<float>& mask,
                     float* gx, bool accumulate) {
  const int64_t bw = keep_bit_words(k);
  const __m512i cut = _mm512_set1_epi32(static_cast<int>(mask.cut));
  const __m512 kept = _mm512_set1_ps(mask.kept), dropped = _mm512_set1_ps(mask.dropped);
  for (int64_t c0 = 0; c0 < k; c0 += 16) {
    const __mmask16 in = first_lanes(k - c0);
    __m512 acc[N];
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < rp; j0 += 16) {
      __m512 wv[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j)
        wv[j] = j0 + j < r ? _mm512_maskz_loadu_ps(in, w + (j0 + j) * k + c0) : _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
#pragma GCC unroll 8
        for (int i = 0; i < N; ++i)
          acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(g[i * rp + j0 + j]), wv[j], acc[i]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) {
      const __mmask16 keep =
          bits ? static_cast<__mmask16>(bits[i * bw + c0 / 16])
               : _mm512_cmplt_epu32_mask(_mm512_maskz_loadu_epi32(in, words + i * k + c0), cut);
      const __m512 m = _mm512_mask_blend_ps(keep, dropped, kept);
      float* out = gx + i * k + c0;
      const __m512 prev = accumulate ? _mm512_maskz_loadu_ps(in, out) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(out, in, _mm512_fmadd_ps(acc[i], m, prev));
    }
  }
}

// Calls tile.template operator()<N>() for N = n (1 to 8): a tile's row
// count as the compile-time constant its registers need.
template <class Tile>
void with_rows(int64_t n, Tile&& tile) {
  switch (n) {
    case 1:
      return tile.template operator()<1>();
    case 2:
      return tile.template operator()<2>();
    case 3:
      return tile.template operator()<3>();
    case 4:
      return tile.template operator()<4>();
    case 5:
      return tile.template operator()<5>();
    case 6:
      return tile.template operator()<6>();
    case 7:
      return tile.template operator()<7>();
    default:
      return tile.template operator()<8>();
  }
}

// f32 block products tiled for r: the rank side padded to rp (a multiple of
// 16, one register per 16), zeros in the padding, so every r takes one path.
struct TiledProducts {
  // weight_grad applies the mask to x as it loads it: the dropped copy of x
  // is never written (a pass over the block in L2 and its read back, about
  // 1% of a QLoRA step).
  static constexpr bool kReadsDroppedCopy = false;
  const float* w;   // [r, k]
  const float* wt;  // [k, rp]: w^T, zero-padded columns
  int64_t k, r, rp;

  // t[rows, r] = xd w^T, 8 rows at a time.
  void forward(const Block<float>& b, float* t) const {
    for (int64_t i0 = 0; i0 < b.rows; i0 += 8)
      for (int64_t j0 = 0; j0 < rp; j0 += 16)
        with_rows(std::min<int64_t>(8, b.rows - i0), [&]<int N>() {
          forward_tile<N>(b.xd + i0 * k, k, wt + j0, rp, first_lanes(r - j0), t + i0 * r + j0, r);
        });
  }

  // gw[r, k] (+)= gt_rows^T xd: per 16 columns of k and 16 rows of gw, 16
  // accumulators over the block's rows. gt is the block's gradient padded
  // to rp columns; xd's values are x's (the block's rows) times the mask's
  // kept or dropped value, the same product drop_block would store.
  void weight_grad(const Block<float>& b, const KeepMask<float>& mask, const float* x,
                   const float* gt, float* gw, bool accumulate) const {
    const int64_t bw = keep_bit_words(k);
    const __m512i cut = _mm512_set1_epi32(static_cast<int>(mask.cut));
    const __m512 kept = _mm512_set1_ps(mask.kept), dropped = _mm512_set1_ps(mask.dropped);
    const float* xb = x + b.m0 * k;
    for (int64_t c0 = 0; c0 < k; c0 += 16) {
      const __mmask16 in = first_lanes(k - c0);
      for (int64_t j0 = 0; j0 < rp; j0 += 16) {
        __m512 acc[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < b.rows; ++i) {
          const __mmask16 keep = b.bits
                                     ? static_cast<__mmask16>(b.bits[i * bw + c0 / 16])
                                     : _mm512_cmplt_epu32_mask(
                                           _mm512_maskz_loadu_epi32(in, b.words + i * k + c0), cut);
          const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(in, xb + i * k + c0),
                                         _mm512_mask_blend_ps(keep, dropped, kept));
          const float* g = gt + i * rp + j0;
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(g[j]), v, acc[j]);
        }
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          if (j0 + j >= r) break;
          float* out = gw + (j0 + j) * k + c0;
          const __m512 prev = accumulate ? _mm512_maskz_loadu_ps(in, out) : _mm512_setzero_ps();
          _mm512_mask_storeu_ps(out, in, _mm512_add_ps(prev, acc[j]));
        }
      }
    }
  }

  // gx rows = (or +=) (gt_rows w) * keep, 8 rows at a time, the keep-mask
  // applied from the block's words as the result is stored.
  void input_grad(const Block<float>& b, const float* gt, const KeepMask<float>& mask, float*,
                  float* gx, bool accumulate) const {
    for (int64_t i0 = 0; i0 < b.rows; i0 += 8)
      with_rows(std::min<int64_t>(8, b.rows - i0), [&]<int N>() {
        input_grad_tile<N>(gt + i0 * rp, rp, w, k, r, b.words ? b.words + i0 * k : nullptr,
                           b.bits ? b.bits + i0 * keep_bit_words(k) : nullptr, mask,
                           gx + (b.m0 + i0) * k, accumulate);
      });
  }
};
#endif

// Forward: each block drawn, dropped and multiplied on one thread; its mask
// kept as bits where keep_bits is set.
template <class T, class Products>
void forward(const DropoutProduct& d, const KeepMask<T>& mask, const Products& prod) {
  const int64_t k = d.k, r = d.r, rows = block_rows(k), bw = keep_bit_words(k);
  const T* x = static_cast<const T*>(d.x);
  T* t = static_cast<T*>(d.t);
  const int64_t blocks = (d.m + rows - 1) / rows;
  parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    const ScratchBuffer words(sizeof(uint32_t) * size_t(rows * k)),
        xd(sizeof(T) * size_t(rows * k));
    for (int64_t i = lo; i < hi; ++i) {
      Block<T> b{.m0 = i * rows, .rows = std::min(rows, d.m - i * rows)};
      draw_block(mask, k, b, words.as<uint32_t>());
      if (d.keep_bits) pack_bits(b.words, b.rows, k, mask.cut, d.keep_bits + b.m0 * bw);
      drop_block(mask, x, k, b, xd.as<T>());
      prod.forward(b, t + b.m0 * r);
    }
  });
}

// The backward over fixed chunks of blocks (their count set by m alone),
// each chunk's gw summed apart and the chunks added in order: the same bits
// on any number of threads. gt's rows are copied per block, padded to
// `padded` columns with zeros (the tiled kernels read whole registers).
template <class T, class Products>
void backward(const DropoutProduct& d, const KeepMask<T>& mask, const Products& prod,
              int64_t padded) {
  const int64_t k = d.k, r = d.r, rows = block_rows(k);
  const T* x = static_cast<const T*>(d.x);
  const T* gt = static_cast<const T*>(d.gt);
  T* gx = static_cast<T*>(d.gx);
  T* gw = static_cast<T*>(d.gw);
  const int64_t blocks = (d.m + rows - 1) / rows;
  constexpr int64_t kMaxChunks = 16;
  const int64_t per_chunk = (blocks + kMaxChunks - 1) / kMaxChunks;
  const int64_t chunks = (blocks + per_chunk - 1) / per_chunk;
  // Each chunk's first block writes its partial sum: no zeroing needed.
  const ScratchBuffer partial_sums(gw ? sizeof(T) * size_t(chunks * r * k) : 0);
  T* partial = partial_sums.as<T>();
  // With the forward's bits nothing is drawn.
  const int64_t bw = keep_bit_words(k);
  const size_t word_count = d.keep_bits ? 0 : size_t(rows * k);
  parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
    // The dropped copy, where the products read it, and the loops' input
    // gradient scratch.
    const ScratchBuffer words(sizeof(uint32_t) * word_count),
        xd(Products::kReadsDroppedCopy ? sizeof(T) * size_t(rows * k) : 0);
    std::vector<T> gt_rows(size_t(rows * padded), T(0));
    for (int64_t c = lo; c < hi; ++c) {
      const int64_t first = c * per_chunk, end = std::min(blocks, first + per_chunk);
      for (int64_t i = first; i < end; ++i) {
        Block<T> b{.m0 = i * rows, .rows = std::min(rows, d.m - i * rows)};
        for (int64_t j = 0; j < b.rows; ++j)
          std::copy(gt + (b.m0 + j) * r, gt + (b.m0 + j + 1) * r, gt_rows.data() + j * padded);
        if (d.keep_bits)
          b.bits = d.keep_bits + b.m0 * bw;
        else
          draw_block(mask, k, b, words.as<uint32_t>());
        if (gw) {
          if constexpr (Products::kReadsDroppedCopy) drop_block(mask, x, k, b, xd.as<T>());
          prod.weight_grad(b, mask, x, gt_rows.data(), partial + c * r * k, i > first);
        }
        // The dropped copy is spent: it is the loops' input gradient scratch.
        if (gx) prod.input_grad(b, gt_rows.data(), mask, xd.as<T>(), gx, d.accumulate_gx);
      }
    }
  });
  if (!gw) return;
  std::memcpy(gw, partial, sizeof(T) * size_t(r * k));
  for (int64_t c = 1; c < chunks; ++c) {
    const T* p = partial + c * r * k;
    for (int64_t i = 0; i < r * k; ++i) gw[i] += p[i];
  }
}

template <class T, class Products>
void run(const DropoutProduct& d, const KeepMask<T>& mask, const Products& prod, int64_t padded) {
  if (d.gt)
    backward<T>(d, mask, prod, padded);
  else
    forward<T>(d, mask, prod);
}

// w^T [k, stride] for the forward, columns past r zero.
template <class T>
std::vector<T> transposed(const T* w, int64_t r, int64_t k, int64_t stride) {
  std::vector<T> wt(size_t(k * stride), T(0));
  for (int64_t j = 0; j < r; ++j)
    for (int64_t c = 0; c < k; ++c) wt[size_t(c * stride + j)] = w[j * k + c];
  return wt;
}

template <class T>
void run_loops(const DropoutProduct& d) {
  run<T>(d, KeepMask<T>(d.mask), LoopProducts<T>{static_cast<const T*>(d.w), d.k, d.r}, d.r);
}

// Without AVX-512, f32 takes the table's unfused steps (the dropped copy
// made whole, then one threaded library product): faster there than the
// portable loops, with the GEMM's order of sums.
template <class T>
struct WholeSteps {
  std::vector<std::unique_ptr<ScratchBuffer>> held;
  T* scratch(int64_t n) {
    return held.emplace_back(std::make_unique<ScratchBuffer>(sizeof(T) * size_t(n)))->as<T>();
  }
  void fill(const RandomFill& f, int64_t n, void* out) { random_fill(f, n, out); }
  void product(int64_t m, int64_t n, int64_t k, MatOperand a, MatOperand b, void* c) {
    gemm<T>(m, n, k, {static_cast<const T*>(a.data), a.rs, a.cs},
            {static_cast<const T*>(b.data), b.rs, b.cs}, static_cast<T*>(c), n);
  }
  void add(int64_t n, const void* src, void* dst) {
    const int64_t one = 1;
    const Operand from{const_cast<void*>(src), dtype_of<T>::value, &one};
    update(UpdateOp::add_scaled, ScalarArgs{1.0, 0.0}, Shape{n},
           Operand{dst, dtype_of<T>::value, &one}, from, from);
  }
};

}  // namespace

void dropout_product(const DropoutProduct& dp) {
  DropoutProduct d = dp;
  draw::resolve_stream(d.mask);
  if (d.m == 0) return;
  if (d.mask.dtype == DType::f64) return run_loops<double>(d);
#if defined(__AVX512F__)
  const int64_t rp = (d.r + 15) / 16 * 16;
  const auto* w = static_cast<const float*>(d.w);
  const std::vector<float> wt = d.gt ? std::vector<float>() : transposed(w, d.r, d.k, rp);
  run<float>(d, KeepMask<float>(d.mask), TiledProducts{w, wt.data(), d.k, d.r, rp}, rp);
#else
  WholeSteps<float> steps;
  dropout_product_steps<float>(d, steps);
#endif
}

}  // namespace quanta::cpu
