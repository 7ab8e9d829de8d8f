// `quanta bench nf4`: the NF4 format and nf4_linear against their floors, all
// measured in the same run.
//   nf4_quantize / nf4_dequantize: a 4096 x 4096 f32 weight to nf4 and back,
//     against a multithreaded memcpy with the same memory traffic (a memcpy
//     of n bytes reads n and writes n, so an op reading r and writing w bytes
//     is floored by a memcpy of (r + w) / 2 bytes). Goal for dequantize:
//     ratio <= 2 (at least 50% of memcpy bandwidth). nf4_dequantize writes
//     into a reused buffer as the floor does; nf4_dequantize_alloc returns a
//     fresh tensor (its pages are zeroed by the kernel first: more traffic).
//   nf4_linear_bB: x [B, 4096] times the nf4 weight, against the engine's f32
//     linear of the same shape (ratio < 1: NF4 is faster). Goals: batch 1
//     below 1, batch 512 within 1.3.
// On a GPU (--device cuda): bench_nf4_cuda.cpp's rows.
#include <algorithm>
#include <cstring>

#include "bench.h"
#include "engine/eigen.h"
#include "quant/nf4/nf4_format.h"
#include "quant/nf4/nf4_linear.h"
#include "quanta.h"

namespace quanta::cli {
namespace {}  // namespace

std::vector<BenchRow> bench_nf4(const BenchOptions& o) {
  if (o.device.is_cuda()) return bench_nf4_cuda(o);
  NoGradGuard no_grad;
  Generator gen(4242);
  const int64_t n_out = o.small ? 256 : 4096, n_in = o.small ? 256 : 4096;
  const Tensor w = randn({n_out, n_in}, gen);
  const Tensor q = quant::quantize_nf4(w);
  const int64_t f32_bytes = static_cast<int64_t>(w.nbytes());
  const int64_t nf4_bytes = static_cast<int64_t>(q.nbytes());
  const int64_t copy_bytes = (f32_bytes + nf4_bytes) / 2;
  const Tensor src = full({copy_bytes}, 1.0, {.dtype = DType::u8});
  const Tensor dst = zeros({copy_bytes}, {.dtype = DType::u8});
  const double memcpy_ms = median_ms(
      o.repeat, [&] { parallel_memcpy(dst.data<uint8_t>(), src.data<uint8_t>(), copy_bytes); });

  std::vector<BenchRow> rows;
  BenchRow quantize{"nf4_quantize"};
  quantize.ms = median_ms(o.repeat, [&] { Tensor t = quant::quantize_nf4(w); });
  quantize.floor_ms = memcpy_ms;
  rows.push_back(quantize);
  // Like the floor, dequantize writes into a buffer touched beforehand; the
  // _alloc row includes allocating (and the kernel zeroing) a fresh output.
  const Tensor out = zeros({n_out, n_in});
  BenchRow dequantize{"nf4_dequantize"};
  dequantize.ms = median_ms(o.repeat, [&] { quant::dequantize_into(q, out); });
  dequantize.floor_ms = memcpy_ms;
  rows.push_back(dequantize);
  BenchRow dequantize_alloc{"nf4_dequantize_alloc"};
  dequantize_alloc.ms = median_ms(o.repeat, [&] { Tensor t = quant::dequantize(q); });
  dequantize_alloc.floor_ms = memcpy_ms;
  rows.push_back(dequantize_alloc);

  for (int64_t batch : {1, 16, 512}) {
    const int64_t b = o.small ? std::min<int64_t>(batch, 64) : batch;
    const Tensor x = randn({b, n_in}, gen);
    BenchRow row{"nf4_linear_b" + std::to_string(batch)};
    row.ms = median_ms(o.repeat, [&] { Tensor y = quant::nf4_linear(x, q); });
    row.floor_ms = median_ms(o.repeat, [&] { Tensor y = linear(x, w); });
    rows.push_back(row);
  }
  return rows;
}

}  // namespace quanta::cli
