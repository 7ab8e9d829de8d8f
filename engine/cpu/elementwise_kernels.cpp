// The CPU's elementwise families: fill, cast/copy, unary, binary, in-place
// update and where. The math is the shared functors (engine/kernels/);
// this file adds the loops, the dtype switch and the Eigen vector forms.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "engine/cpu/convert.h"
#include "engine/cpu/kernels.h"
#include "engine/cpu/loop.h"
#include "engine/cpu/parallel.h"
#include "engine/cpu/unary_vector.h"
#include "engine/dispatch.h"
#include "engine/eigen.h"

namespace quanta::cpu {
namespace {

// dst[i] = f(src[i]) over n contiguous values: the Eigen vector form where
// the functor has one (then its fixup for what the vector form gets wrong).
// Over a map of any length Eigen would run the scalar form on the values
// before the first aligned packet and after the last whole one, so that a
// value's bits would follow its address and where a thread's piece ends.
// Instead every value goes through whole packets: whole blocks straight into
// a 64-byte aligned dst, the values before its first aligned address and
// after the last whole block (or all of them, in place: the fixup reads src
// after the vector pass) through aligned buffers, the last one padded.
template <class T, class F>
void unary_piece(const F& f, const T* src, T* dst, int64_t n) {
  if constexpr (VectorForm<F>::has) {
    constexpr int64_t kBlock = 64;  // a multiple of every packet's length
    using Block = Eigen::Array<T, kBlock, 1>;
    using AlignedOut = Eigen::Map<Block, Eigen::Aligned64>;
    const auto buffered = [](const T* from, T* to, int64_t m) {
      alignas(64) T in[kBlock];
      alignas(64) T out[kBlock];
      std::copy(from, from + m, in);
      std::fill(in + m, in + kBlock, T(1));
      AlignedOut result(out);
      result = VectorForm<F>::apply(Eigen::Map<const Block, Eigen::Aligned64>(in));
      VectorForm<F>::fixup(in, out, m);
      std::copy(out, out + m, to);
    };
    int64_t a = 0;
    if (src != dst) {
      const auto misalign = reinterpret_cast<uintptr_t>(dst) % 64;
      const int64_t head =
          std::min<int64_t>(n, misalign ? int64_t(64 - misalign) / int64_t(sizeof(T)) : 0);
      if (head > 0) buffered(src, dst, head);
      for (a = head; a + kBlock <= n; a += kBlock) {
        AlignedOut result(dst + a);
        result = VectorForm<F>::apply(Eigen::Map<const Block>(src + a));
        VectorForm<F>::fixup(src + a, dst + a, kBlock);
      }
    }
    for (; a < n; a += kBlock) buffered(src + a, dst + a, std::min(kBlock, n - a));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = f(src[i]);
  }
}

// out = f(in) over runs of any strides (defined below, beside the 16-bit
// paths that share it).
template <class S, class C, class F>
void unary_runs(const F& f, const Shape& shape, const Operand& out, const Operand& in);

template <class T, class F>
void unary_typed(const F& f, const Shape& shape, const Operand& out, const Operand& in) {
  if constexpr (VectorForm<F>::has) {
    if (dense_strides(shape, in.strides) && dense_strides(shape, out.strides)) {
      const T* src = static_cast<const T*>(in.data);
      T* dst = static_cast<T*>(out.data);
      parallel_for(0, numel_of(shape), kGrainElements, [&](int64_t lo, int64_t hi) {
        // In L1/L2-sized pieces, so the fixup pass reads what the vector
        // pass just touched instead of streaming the chunk from memory again.
        constexpr int64_t kPiece = 8192;
        for (int64_t a = lo; a < hi; a += kPiece)
          unary_piece(f, src + a, dst + a, std::min(hi, a + kPiece) - a);
      });
    } else {
      // Through the vector form too, so that a strided tensor's values get
      // the bits a contiguous one's get.
      unary_runs<T, T>(f, shape, out, in);
    }
    return;
  }
  map<T, T>(shape, f, out, in);
}

// A copy whose source is transposed against its destination: the
// destination's innermost dim steps through the source with a long stride
// while another dim, j, is the source's innermost. A plain walk then reads one
// value per cache line and comes back to every line for the next row (a
// [4096, 4096] transpose took 40x a memcpy); this one walks square tiles of
// the two dims, reading and writing whole lines. False (nothing copied) for
// any other layout.
template <class D, class S>
bool copy_transposed(const Shape& shape, const Operand& dst, const Operand& src) {
  constexpr int64_t kTile = 32;
  const int nd = static_cast<int>(shape.size());
  if (nd < 2) return false;
  const int last = nd - 1;
  if (dst.strides[last] != 1 || src.strides[last] == 1 || src.strides[last] == 0 ||
      shape[last] < kTile)
    return false;
  int j = -1;
  for (int d = 0; d < last; ++d)
    if (src.strides[d] == 1 && shape[d] >= kTile) j = d;
  if (j < 0) return false;
  int64_t outer = 1;
  for (int d = 0; d < last; ++d)
    if (d != j) outer *= shape[d];
  const int64_t nj = shape[j], nl = shape[last];
  const int64_t tiles_j = (nj + kTile - 1) / kTile, tiles_l = (nl + kTile - 1) / kTile;
  D* out = static_cast<D*>(dst.data);
  const S* in = static_cast<const S*>(src.data);
  const int64_t dj = dst.strides[j], sl = src.strides[last];
  parallel_for(0, outer * tiles_j * tiles_l, kGrainElements / (kTile * kTile),
               [&](int64_t lo, int64_t hi) {
                 for (int64_t job = lo; job < hi; ++job) {
                   const int64_t lb = job % tiles_l, jb = job / tiles_l % tiles_j;
                   int64_t rest = job / tiles_l / tiles_j, od = 0, os = 0;
                   for (int d = last - 1; d >= 0; --d) {
                     if (d == j) continue;
                     const int64_t idx = rest % shape[d];
                     rest /= shape[d];
                     od += idx * dst.strides[d];
                     os += idx * src.strides[d];
                   }
                   const int64_t j0 = jb * kTile, l0 = lb * kTile;
                   const int64_t mj = std::min(nj - j0, kTile), ml = std::min(nl - l0, kTile);
                   // Source lines in, destination lines out, each whole and in
                   // turn, through a buffer: the tile's lines lie a power of two
                   // apart in a square tensor, and touched together they would
                   // share a cache set.
                   D buf[kTile][kTile];
                   for (int64_t l = 0; l < ml; ++l)
                     for (int64_t i = 0; i < mj; ++i)
                       buf[i][l] = cast<D>(in[os + (j0 + i) + (l0 + l) * sl]);
                   for (int64_t i = 0; i < mj; ++i)
                     for (int64_t l = 0; l < ml; ++l) out[od + (j0 + i) * dj + l0 + l] = buf[i][l];
                 }
               });
  return true;
}

// 16-bit floats (bf16, f16; the table's half_elementwise): every element is
// computed in f32 and rounded once, the bits of widening the operands, the
// f32 kernel and narrowing the result, without those two passes over memory.
// Each run goes in L1-sized pieces: operands widened into f32 buffers (unit
// strides vectorise), the f32 loop or vector form over the buffers, the
// result narrowed into place.
constexpr int64_t kHalfPiece = 1024;

template <class H, class C = float>
void widen(const char* base, int64_t stride, int64_t from, int64_t m, C* out) {
  const H* src = reinterpret_cast<const H*>(base);
  if (stride == 1) {
    for (int64_t i = 0; i < m; ++i) out[i] = static_cast<C>(src[from + i]);
  } else if (stride == 0) {
    std::fill(out, out + m, static_cast<C>(src[0]));
  } else {
    for (int64_t i = 0; i < m; ++i) out[i] = static_cast<C>(src[(from + i) * stride]);
  }
}

template <class O, class C = float>
void narrow(const C* in, int64_t m, char* base, int64_t stride, int64_t from) {
  O* dst = reinterpret_cast<O*>(base);
  if (stride == 1) {
    for (int64_t i = 0; i < m; ++i) dst[from + i] = cast<O>(in[i]);
  } else {
    for (int64_t i = 0; i < m; ++i) dst[(from + i) * stride] = cast<O>(in[i]);
  }
}

// Each run's values gathered into a buffer of the compute type C (f32 for
// 16-bit storage S, else S itself), unary_piece over it, the results
// scattered back (narrowed).
template <class S, class C, class F>
void unary_runs(const F& f, const Shape& shape, const Operand& out, const Operand& in) {
  for_each_run<2>(shape, {&out, &in},
                  [&](int64_t n, const std::array<char*, 2>& b, const std::array<int64_t, 2>& s) {
                    C x[kHalfPiece], y[kHalfPiece];
                    for (int64_t a = 0; a < n; a += kHalfPiece) {
                      const int64_t m = std::min(kHalfPiece, n - a);
                      widen<S, C>(b[1], s[1], a, m, x);
                      unary_piece(f, x, y, m);
                      narrow<S, C>(y, m, b[0], s[0], a);
                    }
                  });
}

// out = f(x, y) (O: the 16-bit dtype, or bool for a predicate).
template <class O, class H, class F>
void binary_half(const F& f, const Shape& shape, const Operand& out, const Operand& a,
                 const Operand& b) {
  for_each_run<3>(shape, {&out, &a, &b},
                  [&](int64_t n, const std::array<char*, 3>& p, const std::array<int64_t, 3>& s) {
                    float x[kHalfPiece], y[kHalfPiece], r[kHalfPiece];
                    for (int64_t at = 0; at < n; at += kHalfPiece) {
                      const int64_t m = std::min(kHalfPiece, n - at);
                      widen<H>(p[1], s[1], at, m, x);
                      widen<H>(p[2], s[2], at, m, y);
                      if constexpr (std::is_same_v<O, bool>) {
                        bool* o = reinterpret_cast<bool*>(p[0]);
                        for (int64_t i = 0; i < m; ++i)
                          o[(at + i) * s[0]] = static_cast<bool>(f(x[i], y[i]));
                      } else {
                        for (int64_t i = 0; i < m; ++i) r[i] = static_cast<float>(f(x[i], y[i]));
                        narrow<H>(r, m, p[0], s[0], at);
                      }
                    }
                  });
}

// dst = f(dst, x, y) in place.
template <class H, class F>
void update_half(const F& f, const Shape& shape, const Operand& dst, const Operand& a,
                 const Operand& b) {
  for_each_run<3>(shape, {&dst, &a, &b},
                  [&](int64_t n, const std::array<char*, 3>& p, const std::array<int64_t, 3>& s) {
                    float d[kHalfPiece], x[kHalfPiece], y[kHalfPiece];
                    for (int64_t at = 0; at < n; at += kHalfPiece) {
                      const int64_t m = std::min(kHalfPiece, n - at);
                      widen<H>(p[0], s[0], at, m, d);
                      widen<H>(p[1], s[1], at, m, x);
                      widen<H>(p[2], s[2], at, m, y);
                      for (int64_t i = 0; i < m; ++i)
                        d[i] = static_cast<float>(f(d[i], x[i], y[i]));
                      narrow<H>(d, m, p[0], s[0], at);
                    }
                  });
}

template <class T, bool Predicate, class F>
void binary_typed(const F& f, const Shape& shape, const Operand& out, const Operand& a,
                  const Operand& b) {
  if constexpr (Predicate) {
    map<bool, T, T>(
        shape, [&](T x, T y) { return static_cast<bool>(f(x, y)); }, out, a, b);
  } else {
    map<T, T, T>(
        shape, [&](T x, T y) { return static_cast<T>(f(x, y)); }, out, a, b);
  }
}

}  // namespace

void fill(const Shape& shape, const Operand& dst, double value) {
  dispatch_all(dst.dtype, "fill_", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T v = cast<T>(value);
    for_each_run<1>(shape, {&dst},
                    [&](int64_t n, const std::array<char*, 1>& b, const std::array<int64_t, 1>& s) {
                      T* p = reinterpret_cast<T*>(b[0]);
                      for (int64_t i = 0; i < n; ++i) p[i * s[0]] = v;
                    });
  });
}

void copy(const Shape& shape, const Operand& dst, const Operand& src) {
  dispatch_all(dst.dtype, "copy_", [&](auto dtag) {
    using D = typename decltype(dtag)::type;
    dispatch_all(src.dtype, "copy_", [&](auto stag) {
      using S = typename decltype(stag)::type;
      if (copy_transposed<D, S>(shape, dst, src)) return;
      map<D, S>(
          shape, [](S v) { return cast<D>(v); }, dst, src);
    });
  });
}

void copy_blocks(DType dtype, const CopyBlockList& blocks) {
  const std::size_t width = element_size(dtype);
  for (int64_t b = 0; b < blocks.count; ++b) {
    const CopyBlock& k = blocks.data[b];
    const auto* src = static_cast<const unsigned char*>(k.src);
    auto* dst = static_cast<unsigned char*>(k.dst);
    if (k.rows * k.cols == 0) continue;
    if (k.dst_ld == k.cols || k.rows == 1) {
      // One run of bytes: cut into pieces for the threads.
      parallel_for(0, k.rows * k.cols, kGrainElements, [&](int64_t lo, int64_t hi) {
        std::memcpy(dst + lo * width, src + lo * width, static_cast<std::size_t>(hi - lo) * width);
      });
      continue;
    }
    const std::size_t row_bytes = static_cast<std::size_t>(k.cols) * width;
    const int64_t grain = std::max<int64_t>(1, kGrainElements / k.cols);
    parallel_for(0, k.rows, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r)
        std::memcpy(dst + static_cast<std::size_t>(r * k.dst_ld) * width,
                    src + static_cast<std::size_t>(r) * row_bytes, row_bytes);
    });
  }
}

void unary(UnaryOp op, const ScalarArgs& args, const Shape& shape, const Operand& out,
           const Operand& in) {
  if (visit_half(in.dtype, [&](auto tag) {
        using H = typename decltype(tag)::type;
        visit_functor(op, args, [&](auto f) { unary_runs<H, float>(f, shape, out, in); });
      }))
    return;
  dispatch_float(in.dtype, op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    visit_functor(op, args, [&](auto f) { unary_typed<T>(f, shape, out, in); });
  });
}

void binary(BinaryOp op, const Shape& shape, const Operand& out, const Operand& a,
            const Operand& b) {
  if (visit_half(a.dtype, [&](auto tag) {
        using H = typename decltype(tag)::type;
        visit_functor(op, [&](auto f, auto writes_bool) {
          using O = std::conditional_t<decltype(writes_bool)::value, bool, H>;
          binary_half<O, H>(f, shape, out, a, b);
        });
      }))
    return;
  dispatch_numeric(a.dtype, op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    visit_functor(op, [&](auto f, auto writes_bool) {
      binary_typed<T, decltype(writes_bool)::value>(f, shape, out, a, b);
    });
  });
}

void update(UpdateOp op, const ScalarArgs& args, const Shape& shape, const Operand& dst,
            const Operand& a, const Operand& b) {
  if (visit_half(dst.dtype, [&](auto tag) {
        using H = typename decltype(tag)::type;
        visit_functor(op, args, [&](auto f) { update_half<H>(f, shape, dst, a, b); });
      }))
    return;
  dispatch_numeric(dst.dtype, op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    visit_functor(op, args, [&](auto f) { map<T, T, T, T>(shape, f, dst, dst, a, b); });
  });
}

void where(const Shape& shape, const Operand& out, const Operand& cond, const Operand& a,
           const Operand& b) {
  dispatch_all(out.dtype, "where", [&](auto tag) {
    using T = typename decltype(tag)::type;
    map<T, bool, T, T>(
        shape, [](bool k, T x, T y) { return k ? x : y; }, out, cond, a, b);
  });
}

void add_n(DType dtype, const TermList& terms, int64_t n, void* out) {
  dispatch_float(dtype, "add_n", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* dst = static_cast<T*>(out);
    const auto term = [&](int64_t t) { return static_cast<const T*>(terms.data[t]); };
    parallel_for(0, n, kGrainElements, [&](int64_t lo, int64_t hi) {
      // Blocks that stay in L1 while every term is added into them in order.
      constexpr int64_t kBlock = 2048;
      for (int64_t b = lo; b < hi; b += kBlock) {
        const int64_t e = std::min(hi, b + kBlock);
        const T* s0 = term(0);
        for (int64_t i = b; i < e; ++i) dst[i] = s0[i];
        for (int64_t t = 1; t < terms.count; ++t) {
          const T* st = term(t);
          for (int64_t i = b; i < e; ++i) dst[i] += st[i];
        }
      }
    });
  });
}

}  // namespace quanta::cpu
