// CUDA entries bit_probabilities(_grad), bit_product(_grad) and clamped_entropy
// (quant/kernels/table.h). The products are quant/kernels/functors.h's, one
// thread per output element (forward) or per row and bit (backward), in the
// CPU's multiplication order.
#include <vector>

#include "quant/cuda/device.cuh"
#include "quant/cuda/kernels.h"
#include "quant/kernels/entropy_walk.h"
#include "quant/kernels/functors.h"

namespace quanta::quant::quant_cuda {
namespace {

template <class T>
__global__ void bit_probabilities_kernel(const T* z, int64_t rows, int64_t d, int64_t begin,
                                         int64_t k, T* pi) {
  QUANTA_GRID_STRIDE(i, rows * k) {
    fn::bit_probabilities(z[(i / k) * d + begin + i % k], pi + 2 * i);
  }
}

template <class T>
__global__ void bit_probabilities_grad_kernel(const T* z, const T* g, int64_t rows, int64_t d,
                                              int64_t begin, int64_t k, T* dz) {
  QUANTA_GRID_STRIDE(i, rows * k) {
    const int64_t at = (i / k) * d + begin + i % k;
    T p[2];
    fn::bit_probabilities(z[at], p);
    dz[at] = fn::bit_probability_grad(g[2 * i], g[2 * i + 1], p[0], p[1]);
  }
}

template <class T>
__global__ void bit_product_kernel(const T* pi, int64_t rows, int64_t k, T* out) {
  const int64_t n = int64_t(1) << k;
  QUANTA_GRID_STRIDE(i, rows * n) { out[i] = fn::bit_product_at(pi + (i / n) * 2 * k, k, i % n); }
}

template <class T>
__global__ void bit_product_grad_kernel(const T* pi, const T* gP, int64_t rows, int64_t k,
                                        T* grad_pi) {
  const int64_t n = int64_t(1) << k;
  QUANTA_GRID_STRIDE(i, rows * k) {
    const int64_t r = i / k, j = i % k;
    fn::bit_product_grad_at(pi + r * 2 * k, k, gP + r * n, j, grad_pi + r * 2 * k + 2 * j);
  }
}

template <class F>
void dispatch_lfq(DType dtype, F&& f) {
  if (dtype == DType::f64) return f(cuda::Tag<double>{});
  if (dtype == DType::f32) return f(cuda::Tag<float>{});
  throw std::invalid_argument("[LFQ] bit probabilities must be f32 or f64");
}

}  // namespace

void bit_probabilities(DType dtype, const void* z, int64_t rows, int64_t d, int64_t begin,
                       int64_t k, void* pi) {
  dispatch_lfq(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const cuda::LaunchConfig g = grid_for(rows * k);
    if (g.blocks == 0) return;
    bit_probabilities_kernel<T><<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(
        static_cast<const T*>(z), rows, d, begin, k, static_cast<T*>(pi));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

void bit_probabilities_grad(DType dtype, const void* z, const void* g, int64_t rows, int64_t d,
                            int64_t begin, int64_t k, void* dz) {
  dispatch_lfq(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const cuda::LaunchConfig c = grid_for(rows * k);
    if (c.blocks == 0) return;
    bit_probabilities_grad_kernel<T>
        <<<static_cast<unsigned>(c.blocks), c.threads, 0, cuda::stream()>>>(
            static_cast<const T*>(z), static_cast<const T*>(g), rows, d, begin, k,
            static_cast<T*>(dz));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

void bit_product(DType dtype, const void* pi, int64_t rows, int64_t k, void* out) {
  dispatch_lfq(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const cuda::LaunchConfig g = grid_for(rows << k);
    if (g.blocks == 0) return;
    bit_product_kernel<T><<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(
        static_cast<const T*>(pi), rows, k, static_cast<T*>(out));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

void bit_product_grad(DType dtype, const void* pi, const void* grad_out, int64_t rows, int64_t k,
                      void* grad_pi) {
  dispatch_lfq(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const cuda::LaunchConfig g = grid_for(rows * k);
    if (g.blocks == 0) return;
    bit_product_grad_kernel<T><<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(
        static_cast<const T*>(pi), static_cast<const T*>(grad_out), rows, k,
        static_cast<T*>(grad_pi));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

namespace {

// A thread per token: the walk of quant/kernels/entropy_walk.h on local
// scratch sized for kEntropyWalkMaxBits.
__global__ void clamped_entropy_kernel(const double* z, int64_t rows, int64_t d, double log_eps,
                                       double* h, double* grad) {
  double a[kEntropyWalkMaxBits], e[kEntropyWalkMaxBits], flip_weight[kEntropyWalkMaxBits];
  int64_t order[kEntropyWalkMaxBits];
  fn::EntropyFrame stack[kEntropyWalkMaxBits + 1];
  QUANTA_GRID_STRIDE(r, rows) {
    const double* zr = z + r * d;
    const double log_best = fn::entropy_magnitudes(zr, d, a, e);
    fn::order_by_magnitude(a, d, order);
    h[r] = fn::clamped_entropy_walk(zr, d, log_eps, log_best, a, e, order, flip_weight, stack,
                                    grad + r * d);
  }
}

// Beyond kEntropyWalkMaxBits the walk's scratch would not fit a thread: z,
// h and grad are staged through host memory and the CPU entry does the work.
void clamped_entropy_on_host(const double* z, int64_t rows, int64_t d, double* h, double* grad) {
  const size_t nz = static_cast<size_t>(rows * d);
  std::vector<double> hz(nz), hh(static_cast<size_t>(rows)), hg(nz);
  QUANTA_CUDA_CHECK(
      cudaMemcpyAsync(hz.data(), z, sizeof(double) * nz, cudaMemcpyDeviceToHost, cuda::stream()));
  QUANTA_CUDA_CHECK(cudaStreamSynchronize(cuda::stream()));
  quant_cpu::table().clamped_entropy(hz.data(), rows, d, hh.data(), hg.data());
  QUANTA_CUDA_CHECK(cudaMemcpyAsync(h, hh.data(), sizeof(double) * hh.size(),
                                    cudaMemcpyHostToDevice, cuda::stream()));
  QUANTA_CUDA_CHECK(cudaMemcpyAsync(grad, hg.data(), sizeof(double) * nz, cudaMemcpyHostToDevice,
                                    cuda::stream()));
  // The host buffers die here: the copies must be done first.
  QUANTA_CUDA_CHECK(cudaStreamSynchronize(cuda::stream()));
}

}  // namespace

// The clamped entropy: a data-dependent walk per token (a handful of codes
// for a confident token, 2^d for a uniform one), one thread each.
void clamped_entropy(const double* z, int64_t rows, int64_t d, double* h, double* grad) {
  if (rows == 0) return;
  if (d > kEntropyWalkMaxBits) return clamped_entropy_on_host(z, rows, d, h, grad);
  const cuda::LaunchConfig g = grid_for(rows);
  clamped_entropy_kernel<<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(
      z, rows, d, std::log(kEntropyEps), h, grad);
  QUANTA_CUDA_CHECK_LAUNCH();
}

}  // namespace quanta::quant::quant_cuda
