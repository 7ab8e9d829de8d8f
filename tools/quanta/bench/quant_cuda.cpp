// `quanta bench quant --device cuda`: the VQ nearest-code search on a GPU
// against the cuBLAS GEMM of the same shape, timed in turns (gpu.h).
//   vq_nearest_8192x256_kK  nearest_codes of 8192 tokens of dim 256 against
//     K = 1024 and 16384 codes, euclidean and (_cosine) cosine, against the
//     f32 GEMM x [8192, 256] x codes^T [256, K] (the distance GEMM the search
//     is built on: at most 1.2x of it is the goal, so the argmin and
//     the tiling cost at most a fifth more). Both include allocating their
//     outputs; the GEMM's codes^T is made once beforehand.
//   vq_code_statistics_65536x256_k1024  the codebook EMA's counts and sums
//     (code_statistics) of 65536 tokens of dim 256 assigned at random to 1024
//     codes, and (_one_code) all to one code, the worst case for a
//     per-code split; against a device copy that moves x's bytes once (a
//     copy of half of them: read and write). Sorting the assignment costs
//     on top of reading x, so about 1.5 would be good.
// --size small: 512 tokens of dim 64 against 1/16 of the codes, 4096 tokens
// for the statistics (row names stay the same).
#include "bench.h"
#include "gpu.h"
#include "quant/vq/code_statistics.h"
#include "quant/vq/nearest_code.h"
#include "quanta.h"

namespace quanta::cli {

std::vector<BenchRow> bench_quant_cuda(const BenchOptions& o) {
  NoGradGuard no_grad;
  const GpuTimer gpu{o.device, o.repeat};
  Generator gen(1818);
  const int64_t tokens = o.small ? 512 : 8192, dim = o.small ? 64 : 256;
  const Tensor x = randn({tokens, dim}, gen).to(gpu.device);
  std::vector<BenchRow> rows;
  for (int64_t k : {1024, 16384})
    for (bool cosine : {false, true}) {
      const std::string name =
          "vq_nearest_8192x256_k" + std::to_string(k) + (cosine ? "_cosine" : "");
      rows.push_back(row_or_error(name, [&] {
        const Tensor codes = randn({o.small ? k / 16 : k, dim}, gen).to(gpu.device);
        const Tensor codes_t = transpose(codes, 0, 1).contiguous();
        const std::vector<double> ms =
            gpu.time({[&] { Tensor i = quant::nearest_codes(x, codes, cosine); },
                      [&] { Tensor s = matmul(x, codes_t); }});
        return timed_row(ms[0], ms[1]);
      }));
    }
  for (bool one_code : {false, true}) {
    const std::string name =
        std::string("vq_code_statistics_65536x256_k1024") + (one_code ? "_one_code" : "");
    rows.push_back(row_or_error(name, [&] {
      const int64_t n = o.small ? 4096 : 65536, k = 1024;
      const Device dev = gpu.device;
      const Tensor rows_x = randn({n, dim}, gen).to(dev);
      const Tensor idx = one_code ? zeros({n}, {.dtype = DType::i64, .device = dev})
                                  : randint(0, k, {n}, gen, {.dtype = DType::i64, .device = dev});
      return gpu.against_copy(
          [&] { quant::CodeStatistics s = quant::code_statistics(idx, rows_x, k); },
          rows_x.nbytes());
    }));
  }
  return rows;
}

}  // namespace quanta::cli
