// `quanta bench quant`: the vector-quantizer rows, then the scalar ones (on a
// GPU: quant_cuda.cpp's).
#include "bench.h"

namespace quanta::cli {

std::vector<BenchRow> bench_quant(const BenchOptions& opts) {
  if (opts.device.is_cuda()) return bench_quant_cuda(opts);
  std::vector<BenchRow> rows = bench_quant_vq(opts);
  for (BenchRow& r : bench_quant_scalar(opts)) rows.push_back(std::move(r));
  return rows;
}

}  // namespace quanta::cli
