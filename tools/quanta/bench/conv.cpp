// The convolution rows of `quanta bench engine`: each layer of `quanta
// train`'s VQ-VAE at batch 64, forward and backward as training runs it
// (weight and bias gradients everywhere, the input gradient everywhere but
// the first layer, whose input is the image). The floor is the time a large
// GEMM (1024^3 through quanta's matmul; 8192^3 on a GPU, cuBLAS's peak shape)
// takes for the same FLOPs, timed in turns with the layer so the machine's
// load hits both alike: ratio 1 means the layer runs at the GEMM's rate.
// On the CPU the activations are channels last, as the VQ-VAE keeps them;
// on a GPU channels first, the CUDA kernels' layout. On a CPU whose build
// has oneDNN, each layer also gets a row <layer>_onednn: the same step
// against itself with oneDNN's kernels off (our own kernels), timed in the
// same turns: below 1 where oneDNN's are the faster ones.
#include <cmath>

#include "bench.h"
#include "engine/cpu/conv_onednn.h"
#include "engine/cpu/gemm_bf16.h"
#include "quanta.h"

namespace quanta::cli {
namespace {

struct ConvLayer {
  const char* name;
  int64_t in, out, kernel, stride, padding, size;  // size: input height = width
  bool transposed;
  bool input_grad;
};

// The VQ-VAE's layers in order (tools/quanta/train/vqvae.cpp).
constexpr ConvLayer kMainJob[] = {
    {"conv_enc1_1x28_k4s2", 1, 32, 4, 2, 1, 28, false, false},
    {"conv_enc2_32x14_k4s2", 32, 32, 4, 2, 1, 14, false, true},
    {"conv_enc3_32x7_k3", 32, 32, 3, 1, 1, 7, false, true},
    {"conv_enc4_32x7_k1", 32, 16, 1, 1, 0, 7, false, true},
    {"conv_dec1_16x7_k3", 16, 32, 3, 1, 1, 7, false, true},
    {"convT_dec2_32x7_k4s2", 32, 32, 4, 2, 1, 7, true, true},
    {"convT_dec3_32x14_k4s2", 32, 1, 4, 2, 1, 14, true, true},
};

// Multiply-adds x 2 of one pass (forward, input gradient and weight gradient
// each cost the same).
double pass_flops(const ConvLayer& l, int64_t batch) {
  const int64_t small = l.transposed ? l.size : (l.size + 2 * l.padding - l.kernel) / l.stride + 1;
  const int64_t small_channels = l.transposed ? l.in : l.out;
  const int64_t big_channels = l.transposed ? l.out : l.in;
  return 2.0 * static_cast<double>(batch * small * small) *
         static_cast<double>(small_channels * big_channels * l.kernel * l.kernel);
}

}  // namespace

double main_job_conv_flops(int64_t batch) {
  double flops = 0;
  for (const ConvLayer& l : kMainJob) flops += pass_flops(l, batch) * (l.input_grad ? 3 : 2);
  return flops;
}

std::vector<BenchRow> bench_conv(const BenchOptions& o, Generator& gen,
                                 const std::function<void()>& sync) {
  EnableGradGuard grad;  // the engine suite runs under NoGradGuard
  const bool gpu = o.device.is_cuda();
  const int64_t batch = o.small ? 2 : 64;
  const int64_t g = o.small ? 64 : gpu ? 8192 : 1024;
  // On a GPU a batch of calls must outlast the synchronisation that ends it.
  const int calls = gpu ? 10 : 4;
  const Tensor a = rand({g, g}, gen).to(o.device), b = rand({g, g}, gen).to(o.device);
  const double gemm_flops = 2.0 * static_cast<double>(g * g * g);
  std::vector<BenchRow> rows;
  const ConvLayout layout = gpu ? ConvLayout::nchw : ConvLayout::nhwc;
  for (const ConvLayer& l : kMainJob) {
    try {
      const Shape xs =
          gpu ? Shape{batch, l.in, l.size, l.size} : Shape{batch, l.size, l.size, l.in};
      const Tensor x = rand(xs, gen).to(o.device).requires_grad_(l.input_grad);
      const Tensor w = (l.transposed ? rand({l.in, l.out, l.kernel, l.kernel}, gen)
                                     : rand({l.out, l.in, l.kernel, l.kernel}, gen))
                           .to(o.device)
                           .requires_grad_(true);
      const Tensor bias = rand({l.out}, gen).to(o.device).requires_grad_(true);
      auto step = [&] {
        const Tensor y = l.transposed
                             ? conv_transpose2d(x, w, bias, {l.stride, l.stride},
                                                {l.padding, l.padding}, {0, 0}, 1, {1, 1}, layout)
                             : conv2d(x, w, bias, {l.stride, l.stride}, {l.padding, l.padding},
                                      {1, 1}, 1, layout);
        y.backward(ones_like(y));
      };
      const bool both = !gpu && cpu::bf16_products_built();
      auto ours = [&] {
        const bool was_on = cpu::conv_onednn_enable(false);
        step();
        cpu::conv_onednn_enable(was_on);
      };
      std::vector<std::function<void()>> runs{step, [&] { Tensor c = matmul(a, b); }};
      if (both) runs.push_back(ours);
      const std::vector<double> ms = interleaved_ms(o.repeat, calls, runs, sync);
      const double flops = pass_flops(l, batch) * (l.input_grad ? 3 : 2);  // fwd + bwd
      BenchRow row{l.name};
      row.ms = ms[0];
      row.floor_ms = ms[1] * flops / gemm_flops;
      rows.push_back(row);
      if (both) {
        BenchRow against{std::string(l.name) + "_onednn"};
        against.ms = ms[0];
        against.floor_ms = ms[2];
        rows.push_back(against);
      }
    } catch (const std::exception& e) {
      if (!gpu) throw;  // every CPU kernel exists: a failure there is a bug
      rows.push_back(unavailable_row(l.name, e.what()));
    }
  }
  return rows;
}

}  // namespace quanta::cli
