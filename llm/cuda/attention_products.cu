// CUDA attention as whole-matrix products (llm/kernels/attention_plan.h):
// the plan's executor on the device. Gathers and scatters move heads between
// the [batch, tokens, heads, head_dim] tensors and contiguous scratch in the
// accumulation dtype, cuBLAS runs every product (strided batched, one call
// per query head of a group), and a row pass each way forms the
// probabilities (forward), or the probabilities and the score gradients
// together (backward), with the plan's functions, which the CPU test runs.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>

#include "engine/cuda/scratch.h"
#include "llm/cuda/attention_products.h"
#include "llm/cuda/device.cuh"
#include "llm/kernels/attention_plan.h"

namespace quanta::llm::llm_cuda {
namespace {

namespace plan = attention_plan;

// One matrix of scratch: slot (query side) or pair (key side) rows of width d.
template <class T, class A>
__global__ void gather_kernel(AttentionArgs a, HeadsOperand src, plan::Chunk c, bool query_side,
                              int64_t t, A* dst) {
  const int64_t D = a.head_dim, group = a.heads / a.kv_heads;
  const int64_t n = (query_side ? c.count * group : c.count) * t * D;
  QUANTA_GRID_STRIDE(e, n) {
    const int64_t d = e % D, i = (e / D) % t, s = e / (D * t);
    const plan::Slot sl = plan::slot_of(a, c, query_side ? s : s * group);
    const int64_t head = query_side ? sl.h : sl.hk;
    dst[e] = static_cast<A>(
        static_cast<const T*>(src.data)[sl.b * src.sb + i * src.st + head * src.sh + d]);
  }
}

// Scratch rows back to a contiguous [batch, t, heads, head_dim] tensor.
template <class T, class A>
__global__ void scatter_kernel(AttentionArgs a, plan::Chunk c, bool query_side, int64_t t,
                               const A* src, T* dst) {
  const int64_t D = a.head_dim, group = a.heads / a.kv_heads;
  const int64_t heads = query_side ? a.heads : a.kv_heads;
  const int64_t n = (query_side ? c.count * group : c.count) * t * D;
  QUANTA_GRID_STRIDE(e, n) {
    const int64_t d = e % D, i = (e / D) % t, s = e / (D * t);
    const plan::Slot sl = plan::slot_of(a, c, query_side ? s : s * group);
    const int64_t head = query_side ? sl.h : sl.hk;
    dst[((sl.b * t + i) * heads + head) * D + d] = static_cast<T>(src[e]);
  }
}

// A warp per row of scores: raw q.k in, probabilities out, the row's lse
// written. Three walks of the row (scores and max, sum, probabilities).
template <class A>
__global__ void softmax_rows_kernel(AttentionArgs a, plan::Chunk c, A* s_buf) {
  const int lane = threadIdx.x % kWarp;
  const int64_t group = a.heads / a.kv_heads, tq = a.q_len, tk = a.kv_len;
  QUANTA_WARP_STRIDE(row, c.count * group * tq) {
    const int64_t i = row % tq, slot = row / tq;
    const plan::Slot sl = plan::slot_of(a, c, slot);
    A* s = s_buf + row * tk;
    A m = -INFINITY;
    for (int64_t j = lane; j < tk; j += kWarp) {
      s[j] = plan::row_score<A>(a, s[j], sl.b, sl.h, i, j);
      m = s[j] > m ? s[j] : m;
    }
    for (int o = kWarp / 2; o > 0; o /= 2) {
      const A other = __shfl_xor_sync(0xffffffffu, m, o);
      m = other > m ? other : m;
    }
    A l = 0;
    for (int64_t j = lane; j < tk; j += kWarp) l += plan::row_term(s[j], m);
    l = warp_sum(l);
    const A lse = plan::row_lse(m, l);
    for (int64_t j = lane; j < tk; j += kWarp) s[j] = plan::row_prob(s[j], lse);
    if (lane == 0) static_cast<A*>(a.lse)[(sl.b * a.heads + sl.h) * tq + i] = lse;
  }
}

// The backward's one row pass over the chunk's scores, a warp per row as
// the forward's: raw q.k in s_buf and dp in ds_buf, probabilities from the
// saved lse out into s_buf and the score gradients into ds_buf. A thread
// per element found its row, query and slot by three 64-bit divisions, some
// hundred instructions for each element's few; a warp per row finds them
// once.
template <class A>
__global__ void grad_rows_kernel(AttentionArgs a, plan::Chunk c, A* s_buf, A* ds_buf,
                                 const A* delta) {
  const int lane = threadIdx.x % kWarp;
  const int64_t group = a.heads / a.kv_heads, tq = a.q_len, tk = a.kv_len;
  QUANTA_WARP_STRIDE(row, c.count * group * tq) {
    const int64_t i = row % tq, slot = row / tq;
    const plan::Slot sl = plan::slot_of(a, c, slot);
    const int64_t r = (sl.b * a.heads + sl.h) * tq + i;
    const A lse = static_cast<const A*>(a.lse)[r], dr = delta[r];
    A* s = s_buf + row * tk;
    A* ds = ds_buf + row * tk;
    for (int64_t j = lane; j < tk; j += kWarp) {
      A slope;
      const A p = plan::row_prob(plan::row_score<A>(a, s[j], sl.b, sl.h, i, j, &slope), lse);
      s[j] = p;
      ds[j] = plan::row_score_grad(a, p, ds[j], dr, slope);
    }
  }
}

// How cuBLAS takes a [rows, cols] operand: with unit column stride it is
// row-major, which column-major reads as its transpose (no op), else it is
// column-major (op T). A dim of 1 leaves its stride free, and cuBLAS still
// checks the leading dimension against the stored rows.
cublasOperation_t op_of(const plan::Mats& x) { return x.cs == 1 ? CUBLAS_OP_N : CUBLAS_OP_T; }
int64_t ld_of(const plan::Mats& x, int64_t rows, int64_t cols) {
  if (x.cs == 1) return rows <= 1 ? std::max<int64_t>(x.rs, cols) : x.rs;
  return cols <= 1 ? std::max<int64_t>(x.cs, rows) : x.cs;
}

// cuBLAS on the plan's row-major products: C = A B is, column-major, C^T =
// B^T A^T.
template <class A>
void strided_product(const plan::Product& p, A* const* bufs, bool bf16_products) {
  const auto op = [](const plan::Mats& x) { return op_of(x); };
  const int64_t lda = ld_of(p.a, p.m, p.k), ldb = ld_of(p.b, p.k, p.n);
  const auto ld = [&](const plan::Mats& x) { return &x == &p.a ? lda : ldb; };
  const A* a = bufs[static_cast<int>(p.a.buf)] + p.a.offset;
  const A* b = bufs[static_cast<int>(p.b.buf)] + p.b.offset;
  A* c = bufs[static_cast<int>(p.c.buf)] + p.c.offset;
  const A one = 1, beta = p.accumulate ? A(1) : A(0);
  cublasHandle_t h = quant::quant_cuda::blas_handle();
  if constexpr (std::is_same_v<A, double>) {
    QUANTA_CUBLAS_CHECK(cublasDgemmStridedBatched_64(h, op(p.b), op(p.a), p.n, p.m, p.k, &one, b,
                                                     ld(p.b), p.b.stride, a, ld(p.a), p.a.stride,
                                                     &beta, c, p.c.rs, p.c.stride, p.batch));
  } else if (!bf16_products) {
    QUANTA_CUBLAS_CHECK(cublasSgemmStridedBatched_64(h, op(p.b), op(p.a), p.n, p.m, p.k, &one, b,
                                                     ld(p.b), p.b.stride, a, ld(p.a), p.a.stride,
                                                     &beta, c, p.c.rs, p.c.stride, p.batch));
  } else {  // MixedPrecision: operands rounded to bf16 for the tensor cores, f32 sums
    QUANTA_CUBLAS_CHECK(cublasGemmStridedBatchedEx_64(
        h, op(p.b), op(p.a), p.n, p.m, p.k, &one, b, CUDA_R_32F, ld(p.b), p.b.stride, a, CUDA_R_32F,
        ld(p.a), p.a.stride, &beta, c, CUDA_R_32F, p.c.rs, p.c.stride, p.batch,
        CUBLAS_COMPUTE_32F_FAST_16BF, CUBLAS_GEMM_DEFAULT));
  }
}

constexpr int kBufs = 9;

// The plan's executor: a chunk's scratch, carved per buffer.
template <class T, class A>
struct DeviceExec {
  const AttentionArgs& a;
  const plan::Dims x{a};
  const T* d_out = nullptr;
  const A* delta = nullptr;
  T *gq = nullptr, *gk = nullptr, *gv = nullptr;
  cuda::Scratch<A> scratch;
  std::array<A*, kBufs> bufs{};

  // The backward's buffers only where it runs (scratch_per_pair counts the
  // same ones).
  DeviceExec(const AttentionArgs& args, int64_t chunk_pairs, bool backward)
      : a(args), scratch(chunk_pairs * x.scratch_per_pair(backward)) {
    A* p = scratch.get();
    for (int b = 0; b < kBufs; ++b) {
      const auto buf = static_cast<plan::Buf>(b);
      const bool grad_only = buf == plan::Buf::ds || buf == plan::Buf::dq || buf == plan::Buf::dk ||
                             buf == plan::Buf::dv;
      if (grad_only && !backward) continue;
      bufs[b] = p;
      p += chunk_pairs * x.per_pair(buf);
    }
  }
  A* at(plan::Buf b) const { return bufs[static_cast<int>(b)]; }

  void begin_chunk(const plan::Chunk&) {}
  void gather(const plan::Chunk& c, plan::Buf which) {
    const bool query_side = which == plan::Buf::q || which == plan::Buf::o;
    const HeadsOperand src = which == plan::Buf::q   ? a.q
                             : which == plan::Buf::k ? a.k
                             : which == plan::Buf::v
                                 ? a.v
                                 : HeadsOperand{d_out, x.tq * a.heads * x.d, a.heads * x.d, x.d};
    const int64_t t = query_side ? x.tq : x.tk;
    const cuda::LaunchConfig g = grid_for((query_side ? c.count * x.group : c.count) * t * x.d);
    gather_kernel<T, A><<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(
        a, src, c, query_side, t, at(which));
    QUANTA_CUDA_CHECK_LAUNCH();
  }
  void product(const plan::Product& p) { strided_product<A>(p, bufs.data(), a.bf16_products); }
  void softmax_rows(const plan::Chunk& c) {
    const cuda::LaunchConfig g = warp_grid_for(c.count * x.group * x.tq);
    softmax_rows_kernel<A>
        <<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(a, c, at(plan::Buf::s));
    QUANTA_CUDA_CHECK_LAUNCH();
  }
  void grad_rows(const plan::Chunk& c) {
    const cuda::LaunchConfig g = warp_grid_for(c.count * x.group * x.tq);
    grad_rows_kernel<A><<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(
        a, c, at(plan::Buf::s), at(plan::Buf::ds), delta);
    QUANTA_CUDA_CHECK_LAUNCH();
  }
  void scatter(const plan::Chunk& c, plan::Buf which, T* dst) {
    const bool query_side = which == plan::Buf::o || which == plan::Buf::dq;
    const int64_t t = query_side ? x.tq : x.tk;
    const cuda::LaunchConfig g = grid_for((query_side ? c.count * x.group : c.count) * t * x.d);
    scatter_kernel<T, A><<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(
        a, c, query_side, t, at(which), dst);
    QUANTA_CUDA_CHECK_LAUNCH();
  }
  void scatter_out(const plan::Chunk& c) { scatter(c, plan::Buf::o, static_cast<T*>(a.out)); }
  void scatter_grads(const plan::Chunk& c) {
    scatter(c, plan::Buf::dq, gq);
    scatter(c, plan::Buf::dk, gk);
    scatter(c, plan::Buf::dv, gv);
  }
};

template <class A>
int64_t chunk_pairs(const AttentionArgs& a, bool backward) {
  return plan::pairs_per_chunk(a, backward,
                               plan::kScratchBudgetBytes / static_cast<int64_t>(sizeof(A)));
}

}  // namespace

void attention_products(const AttentionArgs& a) {
  dispatch_llm(a.dtype, "scaled_dot_product_attention", [&](auto types) {
    using T = typename decltype(types)::data;
    using A = typename decltype(types)::acc;
    const int64_t pairs = chunk_pairs<A>(a, false);
    DeviceExec<T, A> exec(a, pairs, false);
    plan::forward(a, pairs, exec);
  });
}

void attention_products_grad(const AttentionArgs& a, const void* grad_out, const void* delta,
                             void* gq, void* gk, void* gv) {
  dispatch_llm(a.dtype, "scaled_dot_product_attention backward", [&](auto types) {
    using T = typename decltype(types)::data;
    using A = typename decltype(types)::acc;
    const int64_t pairs = chunk_pairs<A>(a, true);
    DeviceExec<T, A> exec(a, pairs, true);
    exec.d_out = static_cast<const T*>(grad_out);
    exec.delta = static_cast<const A*>(delta);
    exec.gq = static_cast<T*>(gq);
    exec.gk = static_cast<T*>(gk);
    exec.gv = static_cast<T*>(gv);
    plan::backward(a, pairs, exec);
  });
}

}  // namespace quanta::llm::llm_cuda
