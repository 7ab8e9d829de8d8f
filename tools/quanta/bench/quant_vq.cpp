// The VQ rows of `quanta bench quant`:
//   vq_train_step    VectorQuantize (dim 256, codebook 1024, EMA on, rotation
//                    trick) forward + backward on 8 x 1024 tokens, against its
//                    floor: the plain distance GEMM it contains
//                    ([8192, 256] x [256, 1024], bare Eigen, same threads).
//   rvq8_train_step  ResidualVQ with 8 such layers, against 8 of those GEMMs.
// Each step and its floor are timed in turns (interleaved_ms).
// --size small runs tiny sizes (a smoke test, not a measurement).

#include "bench.h"
#include "engine/eigen.h"
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

// `gemms` distance GEMMs of the step's size, back to back.
struct GemmFloor {
  GemmFloor(const Sizes& s, Generator& gen)
      : n(s.batch * s.tokens),
        x(rand({n, s.dim}, gen)),
        c(rand({s.codebook, s.dim}, gen)),
        d(zeros({n, s.codebook})) {}
  void run(int gemms) const {
    Eigen::Map<const RowMajor> X(x.data<float>(), n, x.size(1));
    Eigen::Map<const RowMajor> C(c.data<float>(), c.size(0), c.size(1));
    Eigen::Map<RowMajor> D(d.data<float>(), n, c.size(0));
    for (int i = 0; i < gemms; ++i) D.noalias() = X * C.transpose();
  }
  int64_t n;
  Tensor x, c, d;
};

}  // namespace

std::vector<BenchRow> bench_quant_vq(const BenchOptions& o) {
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
  const GemmFloor floor(s, gen);
  // Step and floor timed in turns: the machine's load hits both alike.
  const auto vq_ms =
      interleaved_ms(o.repeat, 1,
                     {[&] { train_step([&](const Tensor& t) { return vq->forward(t); }, x, w); },
                      [&] { floor.run(1); }});
  rows.push_back({"vq_train_step", vq_ms[0], vq_ms[1]});

  quant::ResidualVQOptions ro;
  ro.dim = s.dim;
  ro.num_quantizers = 8;
  ro.codebook_sizes = {s.codebook};
  ro.layer.decay = 0.99;
  auto rvq = std::make_shared<quant::ResidualVQ>(ro, gen);
  const auto rvq_ms =
      interleaved_ms(o.repeat, 1,
                     {[&] { train_step([&](const Tensor& t) { return rvq->forward(t); }, x, w); },
                      [&] { floor.run(8); }});
  rows.push_back({"rvq8_train_step", rvq_ms[0], rvq_ms[1]});
  return rows;
}

}  // namespace quanta::cli
