// The elementwise family on CUDA (fill, copy, unary, binary, update, where):
// a grid-stride walk over a StridedIndex calling the shared functors
// (engine/kernels/functors.h), so the math is the CPU's; 16-bit floats are
// computed in f32 inside the same walk.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "engine/cuda/check.cuh"
#include "engine/cuda/chunked_launch.cuh"
#include "engine/cuda/device_types.cuh"
#include "engine/cuda/kernels.h"
#include "engine/cuda/launch.h"
#include "engine/kernels/strided_index.h"
#include "engine/kernels/table.h"

namespace quanta::cuda {
namespace {

// A thread loads several elements before it stores any
// (grid_stride_loads_first); each body splits into load (an element's
// inputs) and store (its result). Where the merged index has one or two dims
// (dense operands, a scalar or row broadcast, a transpose: most calls) the
// offsets come from the fixed-dims form (at most one division each), computed
// again for the store; with three or more (D = 0: a permutation of a 3-d or
// larger tensor, a broadcast over middle dims) the general loop over dims
// computes them once and the store keeps them, two elements ahead. The loop
// stays rolled: unrolled for each of the file's bodies it would more than
// double the file's build time.
template <int D, class Body, int N>
__device__ void walk_loads_first(int64_t n, const StridedIndex<N>& ix, const Body& body) {
  using Loaded = typename Body::Loaded;
  if constexpr (D == 0) {
    struct Element {
      int64_t off[N];
      Loaded v;
    };
    grid_stride_loads_first<2>(
        n,
        [&](int64_t i) {
          Element e;
          ix.offsets(i, e.off);
          e.v = body.load(e.off);
          return e;
        },
        [&](int64_t, const Element& e) { body.store(e.off, e.v); });
  } else {
    // Two dims: two elements ahead, each with its division (more would add
    // to the file's build time more than to the walk's speed).
    constexpr int ahead = D == 1 ? loads_ahead(sizeof(Loaded)) : 2;
    grid_stride_loads_first<ahead>(
        n,
        [&](int64_t i) {
          int64_t off[N];
          ix.template offsets_of_dims<D>(i, off);
          return body.load(off);
        },
        [&](int64_t i, const Loaded& v) {
          int64_t off[N];
          ix.template offsets_of_dims<D>(i, off);
          body.store(off, v);
        });
  }
}

template <int N, class Body>
__global__ void walk_kernel(int64_t n, StridedIndex<N> ix, Body body) {
  if (ix.ndim <= 1) return walk_loads_first<1>(n, ix, body);
  if (ix.ndim == 2) return walk_loads_first<2>(n, ix, body);
  walk_loads_first<0>(n, ix, body);
}

// Runs body(offsets) for every element of `shape`; zero-size launches skipped.
template <int N, class Body>
void walk(const char* op, const Shape& shape, const std::array<const Operand*, N>& ops,
          const Body& body) {
  const int64_t n = numel_of(shape);
  if (n == 0) return;
  std::array<const int64_t*, N> strides;
  for (int k = 0; k < N; ++k) strides[k] = ops[k]->strides;
  const StridedIndex<N> ix = make_strided_index<N>(shape, strides, op);
  const LaunchConfig cfg = launch_config(n, max_blocks());
  walk_kernel<N><<<static_cast<unsigned>(cfg.blocks), cfg.threads, 0, stream()>>>(n, ix, body);
  QUANTA_CUDA_CHECK_LAUNCH();
}

// The bodies: load(offsets) reads an element's inputs, store(offsets, loaded)
// writes its result (walk_kernel).
template <class T>
struct FillBody {
  T* dst;
  T value;
  struct Loaded {};
  __device__ Loaded load(const int64_t (&)[1]) const { return {}; }
  __device__ void store(const int64_t (&o)[1], Loaded) const { dst[o[0]] = value; }
};
template <class D, class S>
struct CopyBody {
  D* dst;
  const S* src;
  struct Loaded {
    S s;
  };
  __device__ Loaded load(const int64_t (&o)[2]) const { return {src[o[1]]}; }
  __device__ void store(const int64_t (&o)[2], Loaded v) const { dst[o[0]] = convert<D>(v.s); }
};
// C: the type the functor computes in, the element type itself or, for the
// 16-bit floats (the table's half_elementwise), f32: each element is widened,
// computed and rounded once, the bits of widening the operands, the f32
// kernel and narrowing, in one pass instead of three.
template <class T, class F, class C = T>
struct UnaryBody {
  F f;
  T* out;
  const T* in;
  struct Loaded {
    T x;
  };
  __device__ Loaded load(const int64_t (&o)[2]) const { return {in[o[1]]}; }
  __device__ void store(const int64_t (&o)[2], Loaded v) const {
    out[o[0]] = static_cast<T>(f(convert<C>(v.x)));
  }
};
template <class O, class T, class F, class C = T>
struct BinaryBody {
  F f;
  O* out;
  const T* a;
  const T* b;
  struct Loaded {
    T a, b;
  };
  __device__ Loaded load(const int64_t (&o)[3]) const { return {a[o[1]], b[o[2]]}; }
  __device__ void store(const int64_t (&o)[3], Loaded v) const {
    out[o[0]] = static_cast<O>(f(convert<C>(v.a), convert<C>(v.b)));
  }
};
template <class T, class F, class C = T>
struct UpdateBody {
  F f;
  T* dst;
  const T* a;
  const T* b;
  struct Loaded {
    T d, a, b;
  };
  __device__ Loaded load(const int64_t (&o)[3]) const { return {dst[o[0]], a[o[1]], b[o[2]]}; }
  __device__ void store(const int64_t (&o)[3], Loaded v) const {
    dst[o[0]] = static_cast<T>(f(convert<C>(v.d), convert<C>(v.a), convert<C>(v.b)));
  }
};
template <class T>
struct WhereBody {
  T* out;
  const bool* cond;
  const T* a;
  const T* b;
  struct Loaded {
    bool c;
    T a, b;
  };
  // Both sides are read (both are operands over the whole shape), so the
  // loads go ahead of the condition.
  __device__ Loaded load(const int64_t (&o)[4]) const { return {cond[o[1]], a[o[2]], b[o[3]]}; }
  __device__ void store(const int64_t (&o)[4], Loaded v) const { out[o[0]] = v.c ? v.a : v.b; }
};

// add_n in launches of up to kTermsPerLaunch terms passed by value: the
// first starts from term 0, each later one from out, so every element adds
// the terms in order.
constexpr int kTermsPerLaunch = 8;

template <class T>
struct TermBatch {
  const T* term[kTermsPerLaunch];
  int count = 0;
  bool from_out = false;
};

template <class T>
__global__ void add_terms_kernel(int64_t n, TermBatch<T> b, T* out) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    T acc = b.from_out ? out[i] : b.term[0][i];
    for (int t = b.from_out ? 0 : 1; t < b.count; ++t) acc += b.term[t][i];
    out[i] = acc;
  }
}

}  // namespace

void add_n(DType dtype, const TermList& terms, int64_t n, void* out) {
  if (n == 0) return;
  dispatch_float(dtype, "add_n", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const LaunchConfig cfg = launch_config(n, max_blocks());
    for (int64_t first = 0; first < terms.count; first += kTermsPerLaunch) {
      TermBatch<T> b;
      b.from_out = first > 0;
      for (int64_t t = first; t < terms.count && b.count < kTermsPerLaunch; ++t)
        b.term[b.count++] = static_cast<const T*>(terms.data[t]);
      add_terms_kernel<T><<<static_cast<unsigned>(cfg.blocks), cfg.threads, 0, stream()>>>(
          n, b, static_cast<T*>(out));
      QUANTA_CUDA_CHECK_LAUNCH();
    }
  });
}

void fill(const Shape& shape, const Operand& dst, double value) {
  dispatch_all(dst.dtype, "fill_", [&](auto tag) {
    using T = typename decltype(tag)::type;
    walk<1>("fill_", shape, {&dst}, FillBody<T>{static_cast<T*>(dst.data), convert<T>(value)});
  });
}

void copy(const Shape& shape, const Operand& dst, const Operand& src) {
  dispatch_all(dst.dtype, "copy_", [&](auto dtag) {
    using D = typename decltype(dtag)::type;
    dispatch_all(src.dtype, "copy_", [&](auto stag) {
      using S = typename decltype(stag)::type;
      walk<2>("copy_", shape, {&dst, &src},
              CopyBody<D, S>{static_cast<D*>(dst.data), static_cast<const S*>(src.data)});
    });
  });
}

namespace {

// Blocks per copy_blocks launch (1.3 KB of kernel argument).
constexpr int kCopyChunk = 32;

struct CopyChunk {
  const void* src[kCopyChunk];
  void* dst[kCopyChunk];
  int64_t rows[kCopyChunk], cols[kCopyChunk], dst_ld[kCopyChunk];
};

// Grid row blockIdx.y copies the chunk's block y, its elements moved as
// unsigned words of their width W.
template <class W>
__global__ void copy_blocks_kernel(CopyChunk c) {
  const int b = static_cast<int>(blockIdx.y);
  const W* src = static_cast<const W*>(c.src[b]);
  W* dst = static_cast<W*>(c.dst[b]);
  const int64_t cols = c.cols[b], ld = c.dst_ld[b], n = c.rows[b] * cols;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (ld == cols) {  // one run (a piece of a cat along dim 0): no division
    for (int64_t i = first; i < n; i += step) dst[i] = src[i];
  } else {
    for (int64_t i = first; i < n; i += step) dst[i / cols * ld + i % cols] = src[i];
  }
}

template <class W>
void copy_block_chunks(const CopyBlockList& blocks) {
  launch_in_chunks<kCopyChunk, CopyChunk>(
      blocks,
      [](CopyChunk& c, int row, const CopyBlock& k) {
        c.src[row] = k.src, c.dst[row] = k.dst;
        c.rows[row] = k.rows, c.cols[row] = k.cols, c.dst_ld[row] = k.dst_ld;
      },
      [](const CopyChunk& c, dim3 grid, int threads) {
        copy_blocks_kernel<W><<<grid, threads, 0, stream()>>>(c);
      },
      [](const CopyBlock& k) { return k.rows * k.cols; });
}

}  // namespace

void copy_blocks(DType dtype, const CopyBlockList& blocks) {
  switch (element_size(dtype)) {
    case 1:
      return copy_block_chunks<uint8_t>(blocks);
    case 2:
      return copy_block_chunks<uint16_t>(blocks);
    case 4:
      return copy_block_chunks<uint32_t>(blocks);
    case 8:
      return copy_block_chunks<uint64_t>(blocks);
    default:
      throw std::logic_error(std::string("[cat] no word for ") + dtype_name(dtype) + "'s elements");
  }
}

void unary(UnaryOp op, const ScalarArgs& args, const Shape& shape, const Operand& out,
           const Operand& in) {
  if (visit_half(in.dtype, [&](auto tag) {
        using H = typename decltype(tag)::type;
        H* o = static_cast<H*>(out.data);
        const H* i = static_cast<const H*>(in.data);
        visit_functor(op, args, [&](auto f) {
          walk<2>(op_name(op), shape, {&out, &in}, UnaryBody<H, decltype(f), float>{f, o, i});
        });
      }))
    return;
  dispatch_float(in.dtype, op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = static_cast<T*>(out.data);
    const T* i = static_cast<const T*>(in.data);
    visit_functor(op, args, [&](auto f) {
      walk<2>(op_name(op), shape, {&out, &in}, UnaryBody<T, decltype(f)>{f, o, i});
    });
  });
}

void binary(BinaryOp op, const Shape& shape, const Operand& out, const Operand& a,
            const Operand& b) {
  if (visit_half(a.dtype, [&](auto tag) {
        using H = typename decltype(tag)::type;
        const H* pa = static_cast<const H*>(a.data);
        const H* pb = static_cast<const H*>(b.data);
        visit_functor(op, [&](auto f, auto writes_bool) {
          using O = std::conditional_t<decltype(writes_bool)::value, bool, H>;
          walk<3>(op_name(op), shape, {&out, &a, &b},
                  BinaryBody<O, H, decltype(f), float>{f, static_cast<O*>(out.data), pa, pb});
        });
      }))
    return;
  dispatch_numeric(a.dtype, op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* pa = static_cast<const T*>(a.data);
    const T* pb = static_cast<const T*>(b.data);
    visit_functor(op, [&](auto f, auto writes_bool) {
      using O = std::conditional_t<decltype(writes_bool)::value, bool, T>;
      walk<3>(op_name(op), shape, {&out, &a, &b},
              BinaryBody<O, T, decltype(f)>{f, static_cast<O*>(out.data), pa, pb});
    });
  });
}

void update(UpdateOp op, const ScalarArgs& args, const Shape& shape, const Operand& dst,
            const Operand& a, const Operand& b) {
  if (visit_half(dst.dtype, [&](auto tag) {
        using H = typename decltype(tag)::type;
        H* d = static_cast<H*>(dst.data);
        const H* pa = static_cast<const H*>(a.data);
        const H* pb = static_cast<const H*>(b.data);
        visit_functor(op, args, [&](auto f) {
          walk<3>(op_name(op), shape, {&dst, &a, &b},
                  UpdateBody<H, decltype(f), float>{f, d, pa, pb});
        });
      }))
    return;
  dispatch_numeric(dst.dtype, op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* d = static_cast<T*>(dst.data);
    const T* pa = static_cast<const T*>(a.data);
    const T* pb = static_cast<const T*>(b.data);
    visit_functor(op, args, [&](auto f) {
      walk<3>(op_name(op), shape, {&dst, &a, &b}, UpdateBody<T, decltype(f)>{f, d, pa, pb});
    });
  });
}

void where(const Shape& shape, const Operand& out, const Operand& cond, const Operand& a,
           const Operand& b) {
  dispatch_all(out.dtype, "where", [&](auto tag) {
    using T = typename decltype(tag)::type;
    walk<4>("where", shape, {&out, &cond, &a, &b},
            WhereBody<T>{static_cast<T*>(out.data), static_cast<const bool*>(cond.data),
                         static_cast<const T*>(a.data), static_cast<const T*>(b.data)});
  });
}

}  // namespace quanta::cuda
