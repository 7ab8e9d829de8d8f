// The CPU's gated MLP activation (SwiGLU, GeGLU), forward and backward, one
// pass each. Pieces of kPiece elements at fixed offsets: each piece widens
// its gate to the accumulation type and takes the activation's exp or tanh
// with Eigen's vector function over the whole padded piece, so every element
// gets the same value whatever the threads' cut (a scalar tail would use
// libm's, a different rounding); the per-element math is
// llm/kernels/functors.h's, which the CUDA entries run too.
#include <algorithm>
#include <type_traits>

#include "engine/cpu/parallel.h"
#include "engine/eigen.h"
#include "llm/cpu/kernels.h"
#include "llm/kernels/functors.h"

namespace quanta::llm::llm_cpu {
namespace {

constexpr int64_t kPiece = 1024;

// x[0, m) = piece of gate widened, e[0, kPiece) = the activation's
// transcendental (fn::gated_transcendental) of each (the tail past m padded
// with zeros, so the vector function runs over whole packets).
template <GatedAct Act, class T, class A>
void widen_and_transcend(const T* gate, int64_t m, A* x, A* e) {
  for (int64_t i = 0; i < m; ++i) x[i] = static_cast<A>(gate[i]);
  std::fill(x + m, x + kPiece, A(0));
  // Aligned and a whole number of packets: no scalar head or tail. SiLU's
  // argument, -x, is formed inside the vector expression (no pass of its
  // own on the MLP's hot path); GELU's cubic needs one.
  using Arr = Eigen::Array<A, Eigen::Dynamic, 1>;
  Eigen::Map<Arr, Eigen::Aligned64> v(e, kPiece);
  if constexpr (Act == GatedAct::silu) {
    v = (-Eigen::Map<const Arr, Eigen::Aligned64>(x, kPiece)).exp();
  } else {
    for (int64_t i = 0; i < kPiece; ++i) e[i] = fn::gated_arg<Act>(x[i]);
    v = v.tanh();
  }
}

// f(lo, m, x, e) for each piece [lo, lo + m) of n, pieces in parallel.
template <GatedAct Act, class T, class A, class F>
void for_pieces(const T* gate, int64_t n, F&& f) {
  const int64_t pieces = (n + kPiece - 1) / kPiece;
  cpu::parallel_for(0, pieces, std::max<int64_t>(1, cpu::kGrainElements / kPiece),
                    [&](int64_t p0, int64_t p1) {
                      // x and e apart by a line more than the piece: stores to
                      // e never look 4 KiB-aliased to loads from x.
                      alignas(64) A buf[2 * kPiece + 64 / sizeof(A)];
                      A* x = buf;
                      A* e = buf + kPiece + 64 / sizeof(A);
                      for (int64_t p = p0; p < p1; ++p) {
                        const int64_t lo = p * kPiece, m = std::min(kPiece, n - lo);
                        widen_and_transcend<Act, T, A>(gate + lo, m, x, e);
                        f(lo, m, x, e);
                      }
                    });
}

// One piece's outputs over unaliased pointers, so the loops vectorise.
template <GatedAct Act, class T, class A>
void out_piece(const A* __restrict x, const A* __restrict e, const T* __restrict up,
               T* __restrict out, int64_t m) {
  for (int64_t i = 0; i < m; ++i)
    out[i] = fn::gated_out<Act, T, A>(x[i], e[i], static_cast<A>(up[i]));
}
template <GatedAct Act, class T, class A>
void grad_up_piece(const A* __restrict x, const A* __restrict e, const T* __restrict g,
                   T* __restrict d_up, int64_t m) {
  for (int64_t i = 0; i < m; ++i)
    d_up[i] = fn::gated_grad_up<Act, T, A>(x[i], e[i], static_cast<A>(g[i]));
}
template <GatedAct Act, class T, class A>
void grad_gate_piece(const A* __restrict x, const A* __restrict e, const T* __restrict up,
                     const T* __restrict g, T* __restrict d_gate, int64_t m) {
  for (int64_t i = 0; i < m; ++i)
    d_gate[i] =
        fn::gated_grad_gate<Act, T, A>(x[i], e[i], static_cast<A>(up[i]), static_cast<A>(g[i]));
}

// f(std::integral_constant<GatedAct, act>{}): the activation as a template
// argument, so each loop is compiled for one.
template <class F>
void dispatch_act(GatedAct act, F&& f) {
  if (act == GatedAct::silu) return f(std::integral_constant<GatedAct, GatedAct::silu>{});
  return f(std::integral_constant<GatedAct, GatedAct::gelu_tanh>{});
}

}  // namespace

void gated_act(DType dtype, GatedAct act, const void* gate_, const void* up_, int64_t n,
               void* out_) {
  dispatch_llm(dtype, "gated_activation", [&](auto types) {
    using T = typename decltype(types)::data;
    using A = typename decltype(types)::acc;
    const T* gate = static_cast<const T*>(gate_);
    const T* up = static_cast<const T*>(up_);
    T* out = static_cast<T*>(out_);
    dispatch_act(act, [&](auto which) {
      constexpr GatedAct Act = decltype(which)::value;
      for_pieces<Act, T, A>(gate, n, [&](int64_t lo, int64_t m, const A* x, const A* e) {
        out_piece<Act, T, A>(x, e, up + lo, out + lo, m);
      });
    });
  });
}

void gated_act_grad(DType dtype, GatedAct act, const void* gate_, const void* up_, const void* g_,
                    int64_t n, void* d_gate_, void* d_up_) {
  dispatch_llm(dtype, "gated_activation backward", [&](auto types) {
    using T = typename decltype(types)::data;
    using A = typename decltype(types)::acc;
    const T* gate = static_cast<const T*>(gate_);
    const T* up = static_cast<const T*>(up_);
    const T* g = static_cast<const T*>(g_);
    T* d_gate = static_cast<T*>(d_gate_);
    T* d_up = static_cast<T*>(d_up_);
    dispatch_act(act, [&](auto which) {
      constexpr GatedAct Act = decltype(which)::value;
      for_pieces<Act, T, A>(gate, n, [&](int64_t lo, int64_t m, const A* x, const A* e) {
        if (d_up) grad_up_piece<Act, T, A>(x, e, g + lo, d_up + lo, m);
        if (d_gate) grad_gate_piece<Act, T, A>(x, e, up + lo, g + lo, d_gate + lo, m);
      });
    });
  });
}

}  // namespace quanta::llm::llm_cpu
