// The VQ rows of `quanta bench quant`:
//   vq_train_step    VectorQuantize (dim 256, codebook 1024, EMA on, rotation
//                    trick) forward + backward on 8 x 1024 tokens, against its
//                    floor: the plain distance GEMM it contains
//                    ([8192, 256] x [256, 1024], bare Eigen, same threads).
//   rvq8_train_step  ResidualVQ with 8 such layers, against 8 of those GEMMs.
// --size small runs tiny sizes (a smoke test, not a measurement).
#include <Eigen/Core>

#include "bench.h"
#include "quant/vq/residual_vq.h"
#include "quant/vq/vector_quantize.h"
#include "quanta.h"

namespace quanta::cli {
namespace {

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

struct Sizes {
  int64_t batch, tokens, dim, codebook;
};

// One training step as a user runs it: forward, loss, backward.
void train_step(const std::function<quant::QuantizeOutput(const Tensor&)>& fwd, const Tensor& x,
                const Tensor& w) {
  x.zero_grad();
  quant::QuantizeOutput out = fwd(x);
  Tensor loss = sum(out.quantized * w) + sum(out.loss);
  loss.backward();
}

// `gemms` distance GEMMs of the step's size, timed back to back.
double gemm_floor(const Sizes& s, int gemms, const BenchOptions& o, Generator& gen) {
  const int64_t n = s.batch * s.tokens;
  const Tensor x = rand({n, s.dim}, gen), c = rand({s.codebook, s.dim}, gen);
  const Tensor d = zeros({n, s.codebook});
  Eigen::Map<const RowMajor> X(x.data<float>(), n, s.dim);
  Eigen::Map<const RowMajor> C(c.data<float>(), s.codebook, s.dim);
  Eigen::Map<RowMajor> D(d.data<float>(), n, s.codebook);
  return median_ms(o.repeat, [&] {
    for (int i = 0; i < gemms; ++i) D.noalias() = X * C.transpose();
  });
}

}  // namespace

std::vector<BenchRow> bench_quant_vq(const BenchOptions& o) {
  Eigen::setNbThreads(num_threads());
  const Sizes s = o.small ? Sizes{2, 64, 32, 64} : Sizes{8, 1024, 256, 1024};
  Generator gen(1234);
  Tensor x = randn({s.batch, s.tokens, s.dim}, gen);
  x.requires_grad_(true);
  const Tensor w = randn({s.batch, s.tokens, s.dim}, gen);
  std::vector<BenchRow> rows;

  quant::VectorQuantizeOptions vo;
  vo.dim = s.dim;
  vo.codebook_size = s.codebook;
  vo.decay = 0.99;
  auto vq = std::make_shared<quant::VectorQuantize>(vo, gen);
  BenchRow vq_row{"vq_train_step"};
  vq_row.ms = median_ms(o.repeat,
                        [&] { train_step([&](const Tensor& t) { return vq->forward(t); }, x, w); });
  vq_row.floor_ms = gemm_floor(s, 1, o, gen);
  rows.push_back(vq_row);

  quant::ResidualVQOptions ro;
  ro.dim = s.dim;
  ro.num_quantizers = 8;
  ro.codebook_sizes = {s.codebook};
  ro.layer.decay = 0.99;
  auto rvq = std::make_shared<quant::ResidualVQ>(ro, gen);
  BenchRow rvq_row{"rvq8_train_step"};
  rvq_row.ms = median_ms(
      o.repeat, [&] { train_step([&](const Tensor& t) { return rvq->forward(t); }, x, w); });
  rvq_row.floor_ms = gemm_floor(s, 8, o, gen);
  rows.push_back(rvq_row);
  return rows;
}

}  // namespace quanta::cli
