// `quanta bench engine`: engine kernels against their floors.
//   matmul_MxKxN: A [M, K] times B [K, N], f32, against a bare Eigen GEMM of
//     the same size on the same threads (Eigen::Map, row-major, noalias()).
//   matmul_bf16_MxKxN: oneDNN's bf16 products (bf16 operands, f32 sums) of
//     the QLoRA step's shapes against the engine's f32 product of the same
//     values, timed in turns: below 1 where bf16 products pay on this CPU,
//     which is what cpu::bf16_gemm_native() decides from the CPU's kind
//     (engine/cpu/gemm_bf16.h); builds without oneDNN leave the rows out.
//   add / exp / sum on a contiguous f32 tensor (sum_dim1 / sum_dim0: the same
//     values as [4096, 4096] over its rows / its columns, a bias gradient's
//     reduction, read in place; transpose: that square copied transposed;
//     add_bf16 / exp_bf16: bf16 values, half the bytes, computed in f32
//     inside the kernel) against a multithreaded memcpy with the same memory
//     traffic: a memcpy of n bytes reads n and writes n, so an op that moves
//     k buffers (add 3, exp and transpose 2, sum 1) is floored by a memcpy of
//     k/2 buffers. A kernel that streams memory as well as memcpy then has
//     ratio 1. Op times include allocating their outputs, as users see them;
//     floors write into buffers touched beforehand.
#include <algorithm>
#include <cstring>
#include <string>

#include "bench.h"
#include "engine/cpu/gemm.h"
#include "engine/cpu/gemm_bf16.h"
#include "engine/eigen.h"
#include "quanta.h"

namespace quanta::cli {
namespace {

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

BenchRow bench_matmul(const std::string& name, int64_t m, int64_t k, int64_t n,
                      const BenchOptions& o, Generator& gen) {
  const Tensor a = rand({m, k}, gen);
  const Tensor b = rand({k, n}, gen);
  const Tensor c = zeros({m, n});
  BenchRow row{name};
  row.ms = median_ms(o.repeat, [&] { Tensor out = matmul(a, b); });
  Eigen::Map<const RowMajor> A(a.data<float>(), m, k);
  Eigen::Map<const RowMajor> B(b.data<float>(), k, n);
  Eigen::Map<RowMajor> C(c.data<float>(), m, n);
  row.floor_ms = median_ms(o.repeat, [&] { C.noalias() = A * B; });
  return row;
}

BenchRow bench_bf16_products(int64_t m, int64_t k, int64_t n, const BenchOptions& o,
                             Generator& gen) {
  const std::string name =
      "matmul_bf16_" + std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n);
  // The bf16 values, and the same values in f32: the two products' sums
  // differ only in their order.
  const Tensor a = randn({m, k}, gen).to(DType::bf16), b = randn({k, n}, gen).to(DType::bf16);
  const Tensor af = a.to(DType::f32), bf = b.to(DType::f32);
  const Tensor c = zeros({m, n});
  float* out = c.data<float>();
  const cpu::MatRef<bf16> ah{a.data<bf16>(), k, 1}, bh{b.data<bf16>(), n, 1};
  const cpu::MatRef<float> a32{af.data<float>(), k, 1}, b32{bf.data<float>(), n, 1};
  BenchRow row{name};
  try {
    const std::vector<double> ms =
        interleaved_ms(o.repeat, 1,
                       {[&] { cpu::gemm_bf16(m, n, k, ah, bh, out, n); },
                        [&] { cpu::gemm<float>(m, n, k, a32, b32, out, n); }});
    row.ms = ms[0];
    row.floor_ms = ms[1];
  } catch (const std::exception& e) {
    return unavailable_row(name, e.what());
  }
  return row;
}

}  // namespace

std::vector<BenchRow> bench_engine(const BenchOptions& o) {
  if (o.device.is_cuda()) return bench_engine_cuda(o);
  NoGradGuard no_grad;
  Generator gen(1234);
  std::vector<BenchRow> rows;
  rows.push_back(o.small ? bench_matmul("matmul_1024", 128, 128, 128, o, gen)
                         : bench_matmul("matmul_1024", 1024, 1024, 1024, o, gen));
  rows.push_back(o.small ? bench_matmul("matmul_4096x4096x256", 256, 256, 16, o, gen)
                         : bench_matmul("matmul_4096x4096x256", 4096, 4096, 256, o, gen));
  // Skinny products of the main job: FSQ's projections 16 -> 4
  // -> 16 on a batch's 3136 latent pixels, and one chunk of enc2's
  // convolution as a GEMM (1568 pixels x 512 taps-and-channels x 32 outputs).
  const int64_t tokens = o.small ? 64 : 3136, pixels = o.small ? 64 : 1568;
  rows.push_back(bench_matmul("matmul_3136x16x4", tokens, 16, 4, o, gen));
  rows.push_back(bench_matmul("matmul_3136x4x16", tokens, 4, 16, o, gen));
  rows.push_back(bench_matmul("matmul_1568x512x32", pixels, o.small ? 64 : 512, 32, o, gen));
  if (cpu::bf16_products_built()) {
    // The ~110M QLoRA step's NF4 products: an MLP up-projection's forward
    // (and the down-projection's input gradient), the down-projection's.
    const int64_t t = o.small ? 128 : 2048, h = o.small ? 64 : 768, f = o.small ? 128 : 2048;
    rows.push_back(bench_bf16_products(t, h, f, o, gen));
    rows.push_back(bench_bf16_products(t, f, h, o, gen));
  }

  const int64_t n = o.small ? int64_t(1) << 16 : int64_t(1) << 24;
  const Tensor x = rand({n}, gen);
  const Tensor y = rand({n}, gen);
  const int64_t side = o.small ? 256 : 4096;
  const Tensor square = reshape(x, {side, side});
  const Tensor xh = x.to(DType::bf16), yh = y.to(DType::bf16);
  const int64_t buffer = n * 4;
  // Sources and destinations for the floors, 1.5 buffers each, touched now.
  const Tensor src = full({buffer * 3 / 2}, 1.0, {.dtype = DType::u8});
  const Tensor dst = zeros({buffer * 3 / 2}, {.dtype = DType::u8});
  auto memcpy_floor_bytes = [&](int64_t bytes) {
    return median_ms(o.repeat,
                     [&] { parallel_memcpy(dst.data<uint8_t>(), src.data<uint8_t>(), bytes); });
  };
  auto memcpy_floor = [&](int64_t buffers_moved) {
    return memcpy_floor_bytes(buffers_moved * buffer / 2);
  };
  struct Elementwise {
    const char* name;
    int64_t buffers_moved;
    std::function<void()> op;
  };
  const Elementwise ops[] = {
      {"add", 3, [&] { Tensor z = add(x, y); }},
      {"exp", 2, [&] { Tensor z = exp(x); }},
      {"sum", 1, [&] { Tensor s = sum(x); }},
      {"sum_dim1", 1, [&] { Tensor s = sum(square, {1}); }},
      {"sum_dim0", 1, [&] { Tensor s = sum(square, {0}); }},
      {"transpose", 2, [&] { Tensor t = contiguous(transpose(square, 0, 1)); }},
      // bf16 values, half the bytes: floored by half the f32 rows' copy.
      {"add_bf16", 3, [&] { Tensor z = add(xh, yh); }},
      {"exp_bf16", 2, [&] { Tensor z = exp(xh); }},
  };
  for (const auto& e : ops) {
    BenchRow row{e.name};
    row.ms = median_ms(o.repeat, e.op);
    const bool half = std::string(e.name).ends_with("_bf16");
    row.floor_ms =
        half ? memcpy_floor_bytes(e.buffers_moved * buffer / 4) : memcpy_floor(e.buffers_moved);
    rows.push_back(row);
  }
  // The FSQ recipe's latent norm: 16 groups over a batch of 256 channels-
  // last 64 x 7 x 7 maps (1 image in the small size), forward, then forward
  // and backward, floored by copying the bytes each must move (x in, y out;
  // then also x and the output gradient in, x's gradient out).
  {
    const int64_t batch = o.small ? 1 : 256, numel = batch * 64 * 7 * 7;
    const Tensor latent = permute(rand({batch, 7, 7, 64}, gen), {0, 3, 1, 2});
    const Tensor grad_out = rand({batch, 64, 7, 7}, gen);
    BenchRow fwd{"group_norm_fsq_latent"};
    fwd.ms = median_ms(o.repeat, [&] { Tensor y = group_norm(latent, 16); });
    fwd.floor_ms = memcpy_floor_bytes(2 * numel * 4);
    rows.push_back(fwd);
    BenchRow both{"group_norm_fsq_latent_fwd_bwd"};
    both.ms = median_ms(o.repeat, [&] {
      EnableGradGuard grad;  // the suite runs under NoGradGuard
      const Tensor x = latent.detach().requires_grad_(true);
      group_norm(x, 16).backward(grad_out);
    });
    both.floor_ms = memcpy_floor_bytes(5 * numel * 4);
    rows.push_back(both);
  }
  for (BenchRow& row : bench_conv(o, gen)) rows.push_back(row);
  return rows;
}

}  // namespace quanta::cli
