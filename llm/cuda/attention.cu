// CUDA entries attention and attention_grad (llm/kernels/table.h), a warp
// per query row (forward, dQ) or per key row (dK, dV): each lane holds
// head_dim / 32 values of the row, a dot product is a warp sum, and the keys
// (or queries) are walked in order with the online softmax of the CPU's
// kernel, so memory stays linear in the lengths and every sum has one order.
// Plain and correct rather than fast: the entries run the whole-matrix
// products of attention_products.cu (cuBLAS) where the plan takes the
// sizes, and these where it does not or QUANTA_CUDA_ATTENTION=reference
// asks (the reference to measure and check it against).
#include <cmath>
#include <cstdlib>

#include "llm/cuda/attention_products.h"
#include "llm/cuda/device.cuh"
#include "llm/cuda/kernels.h"
#include "llm/kernels/attention_plan.h"
#include "llm/kernels/functors.h"

namespace quanta::llm::llm_cuda {
namespace {

constexpr int kPerLane = static_cast<int>(kMaxDimPerLane);

template <class A>
struct Lanes {
  A v[kPerLane];
};

template <class T, class A>
__device__ Lanes<A> load_head(const HeadsOperand& op, int64_t b, int64_t t, int64_t h, int64_t D,
                              int lane) {
  const T* row = static_cast<const T*>(op.data) + b * op.sb + t * op.st + h * op.sh;
  Lanes<A> r;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int64_t d = lane + k * kWarp;
    r.v[k] = d < D ? static_cast<A>(row[d]) : A(0);
  }
  return r;
}

template <class A>
__device__ A dot(const Lanes<A>& x, const Lanes<A>& y) {
  A s = 0;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) s += x.v[k] * y.v[k];
  return warp_sum(s);
}

template <class T, class A>
__device__ void store_head(const Lanes<A>& x, A scale, T* row, int64_t D, int lane) {
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int64_t d = lane + k * kWarp;
    if (d < D) row[d] = static_cast<T>(x.v[k] * scale);
  }
}

// scale * q.k + mask (-inf past the causal edge, which keys_seen keeps the
// walks from reaching).
template <class A>
__device__ A score(const AttentionArgs& a, A qk, int64_t b, int64_t h, int64_t i, int64_t j,
                   A* slope = nullptr) {
  return attention_plan::row_score<A>(a, qk, b, h, i, j, slope);
}

// The first key query i sees (a sliding window's first).
__device__ int64_t first_key(const AttentionArgs& a, int64_t i) {
  return a.causal ? fn::first_visible_key(i, a.q_len, a.kv_len, a.window) : 0;
}

__device__ int64_t keys_seen(const AttentionArgs& a, int64_t i) {
  if (!a.causal) return a.kv_len;
  const int64_t end = fn::last_visible_key(i, a.q_len, a.kv_len) + 1;
  return end < 0 ? 0 : (end > a.kv_len ? a.kv_len : end);
}

template <class T, class A>
__global__ void forward_kernel(AttentionArgs a) {
  const int lane = threadIdx.x % kWarp;
  const int64_t D = a.head_dim, H = a.heads, G = a.heads / a.kv_heads;
  QUANTA_WARP_STRIDE(row, a.batch * H * a.q_len) {
    const int64_t i = row % a.q_len, h = (row / a.q_len) % H, b = row / (a.q_len * H);
    const Lanes<A> q = load_head<T, A>(a.q, b, i, h, D, lane);
    Lanes<A> o{};
    A m = -INFINITY, l = 0;
    const int64_t end = keys_seen(a, i);
    for (int64_t j = first_key(a, i); j < end; ++j) {
      const A s = score<A>(a, dot(q, load_head<T, A>(a.k, b, j, h / G, D, lane)), b, h, i, j);
      if (s == -INFINITY) continue;
      const A m_new = s > m ? s : m;
      const A alpha = std::exp(m - m_new), p = std::exp(s - m_new);
      const Lanes<A> v = load_head<T, A>(a.v, b, j, h / G, D, lane);
      l = l * alpha + p;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) o.v[k] = o.v[k] * alpha + p * v.v[k];
      m = m_new;
    }
    T* out = static_cast<T*>(a.out) + ((b * a.q_len + i) * H + h) * D;
    store_head<T, A>(o, l > A(0) ? A(1) / l : A(0), out, D, lane);
    if (lane == 0) static_cast<A*>(a.lse)[row] = l > A(0) ? m + std::log(l) : A(-INFINITY);
  }
}

template <class T, class A>
__global__ void delta_kernel(AttentionArgs a, const T* d_out, A* delta) {
  const int lane = threadIdx.x % kWarp;
  const int64_t D = a.head_dim, H = a.heads;
  const HeadsOperand o{a.out, a.q_len * H * D, H * D, D}, g{d_out, a.q_len * H * D, H * D, D};
  QUANTA_WARP_STRIDE(row, a.batch * H * a.q_len) {
    const int64_t i = row % a.q_len, h = (row / a.q_len) % H, b = row / (a.q_len * H);
    const A d = dot(load_head<T, A>(o, b, i, h, D, lane), load_head<T, A>(g, b, i, h, D, lane));
    if (lane == 0) delta[row] = d;
  }
}

template <class T, class A>
__global__ void query_grad_kernel(AttentionArgs a, const T* d_out, const A* delta, T* gq) {
  const int lane = threadIdx.x % kWarp;
  const int64_t D = a.head_dim, H = a.heads, G = a.heads / a.kv_heads;
  const HeadsOperand g{d_out, a.q_len * H * D, H * D, D};
  QUANTA_WARP_STRIDE(row, a.batch * H * a.q_len) {
    const int64_t i = row % a.q_len, h = (row / a.q_len) % H, b = row / (a.q_len * H);
    const Lanes<A> q = load_head<T, A>(a.q, b, i, h, D, lane);
    const Lanes<A> dO = load_head<T, A>(g, b, i, h, D, lane);
    const A lse = static_cast<const A*>(a.lse)[row], dl = delta[row];
    Lanes<A> dq{};
    const int64_t end = keys_seen(a, i);
    for (int64_t j = first_key(a, i); j < end; ++j) {
      const Lanes<A> k = load_head<T, A>(a.k, b, j, h / G, D, lane);
      A slope;
      const A p = fn::attention_prob(score<A>(a, dot(q, k), b, h, i, j, &slope), lse);
      if (p == A(0)) continue;
      const A ds = slope * fn::attention_score_grad(
                               p, dot(dO, load_head<T, A>(a.v, b, j, h / G, D, lane)), dl);
#pragma unroll
      for (int c = 0; c < kPerLane; ++c) dq.v[c] += ds * k.v[c];
    }
    store_head<T, A>(dq, static_cast<A>(a.scale), gq + ((b * a.q_len + i) * H + h) * D, D, lane);
  }
}

template <class T, class A>
__global__ void key_grad_kernel(AttentionArgs a, const T* d_out, const A* delta, T* gk, T* gv) {
  const int lane = threadIdx.x % kWarp;
  const int64_t D = a.head_dim, H = a.heads, Hk = a.kv_heads, G = a.heads / a.kv_heads;
  const HeadsOperand g{d_out, a.q_len * H * D, H * D, D};
  QUANTA_WARP_STRIDE(row, a.batch * Hk * a.kv_len) {
    const int64_t j = row % a.kv_len, hk = (row / a.kv_len) % Hk, b = row / (a.kv_len * Hk);
    const Lanes<A> k = load_head<T, A>(a.k, b, j, hk, D, lane);
    const Lanes<A> v = load_head<T, A>(a.v, b, j, hk, D, lane);
    Lanes<A> dk{}, dv{};
    const int64_t begin = a.causal ? fn::first_seeing_query(j, a.q_len, a.kv_len) : 0;
    const int64_t end =
        a.causal ? fn::last_seeing_query(j, a.q_len, a.kv_len, a.window) + 1 : a.q_len;
    for (int64_t h = hk * G; h < (hk + 1) * G; ++h)
      for (int64_t i = begin; i < end; ++i) {
        const Lanes<A> q = load_head<T, A>(a.q, b, i, h, D, lane);
        const int64_t r = (b * H + h) * a.q_len + i;
        A slope;
        const A p = fn::attention_prob(score<A>(a, dot(q, k), b, h, i, j, &slope),
                                       static_cast<const A*>(a.lse)[r]);
        if (p == A(0)) continue;
        const Lanes<A> dO = load_head<T, A>(g, b, i, h, D, lane);
        const A ds = slope * fn::attention_score_grad(p, dot(dO, v), delta[r]);
#pragma unroll
        for (int c = 0; c < kPerLane; ++c) {
          dv.v[c] += p * dO.v[c];
          dk.v[c] += ds * q.v[c];
        }
      }
    const int64_t at = ((b * a.kv_len + j) * Hk + hk) * D;
    store_head<T, A>(dk, static_cast<A>(a.scale), gk + at, D, lane);
    store_head<T, A>(dv, A(1), gv + at, D, lane);
  }
}

void check_head_dim(const AttentionArgs& a, const char* op) {
  if (a.head_dim > kWarp * kMaxDimPerLane)
    throw std::invalid_argument(std::string("[") + op + "] head_dim " + std::to_string(a.head_dim) +
                                " is over cuda's limit of " +
                                std::to_string(kWarp * kMaxDimPerLane));
}

unsigned blocks_of(const cuda::LaunchConfig& g) { return static_cast<unsigned>(g.blocks); }

// Whether the whole-matrix products run this call (read per call, so a
// test or a benchmark may switch between the two).
bool takes_products(const AttentionArgs& a, bool backward) {
  const auto path = attention_plan::path_from(std::getenv("QUANTA_CUDA_ATTENTION"));
  const int64_t acc_bytes = a.dtype == DType::f64 ? 8 : 4;
  return attention_plan::takes(a, path, backward, acc_bytes);
}

}  // namespace

void attention(const AttentionArgs& a) {
  check_head_dim(a, "scaled_dot_product_attention");
  if (takes_products(a, false)) return attention_products(a);
  dispatch_llm(a.dtype, "scaled_dot_product_attention", [&](auto types) {
    using T = typename decltype(types)::data;
    using A = typename decltype(types)::acc;
    const cuda::LaunchConfig g = warp_grid_for(a.batch * a.heads * a.q_len);
    if (g.blocks == 0) return;
    forward_kernel<T, A><<<blocks_of(g), g.threads, 0, cuda::stream()>>>(a);
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

void attention_grad(const AttentionArgs& a, const void* grad_out, void* delta, void* gq, void* gk,
                    void* gv) {
  check_head_dim(a, "scaled_dot_product_attention backward");
  const bool products = takes_products(a, true);
  dispatch_llm(a.dtype, "scaled_dot_product_attention backward", [&](auto types) {
    using T = typename decltype(types)::data;
    using A = typename decltype(types)::acc;
    const T* g = static_cast<const T*>(grad_out);
    A* dl = static_cast<A*>(delta);
    const cuda::LaunchConfig q = warp_grid_for(a.batch * a.heads * a.q_len);
    if (q.blocks > 0) {
      delta_kernel<T, A><<<blocks_of(q), q.threads, 0, cuda::stream()>>>(a, g, dl);
      QUANTA_CUDA_CHECK_LAUNCH();
      if (products) return attention_products_grad(a, g, dl, gq, gk, gv);
      query_grad_kernel<T, A>
          <<<blocks_of(q), q.threads, 0, cuda::stream()>>>(a, g, dl, static_cast<T*>(gq));
      QUANTA_CUDA_CHECK_LAUNCH();
    }
    const cuda::LaunchConfig k = warp_grid_for(a.batch * a.kv_heads * a.kv_len);
    if (k.blocks == 0) return;
    key_grad_kernel<T, A><<<blocks_of(k), k.threads, 0, cuda::stream()>>>(
        a, g, dl, static_cast<T*>(gk), static_cast<T*>(gv));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace quanta::llm::llm_cuda
