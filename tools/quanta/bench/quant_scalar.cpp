// The scalar rows of `quanta bench quant`: one train step (forward, the loss
// sum(quantized * w) + aux loss, backward) of FSQ and LFQ, each against a
// floor measured in the same run.
//   fsq_train_step: FSQ [8, 5, 5, 5] with projections from dim 256, 8 x 1024
//     tokens; floor = the same step with the quantizer removed, i.e. the two
//     projection GEMMs forward and backward.
//   lfq_1024_train_step (codebook 2^10, 8 x 1024 tokens) and
//   lfq_65536_train_step (2^16, 1 x 1024 tokens), entropy and commitment
//     losses on, no projections, inputs randn; floor = the same step on the
//     direct path (softmax over all 2^d codes, as the reference computes it).
//     ratio < 1 is how much faster the factorised path is.
//   lfq_65536_train_step_uniform: as above with inputs randn * 1e-4: every
//     code distribution is near uniform, so the per-sample walk visits all
//     2^16 codes of every token (its worst case).

#include "bench.h"
#include "engine/eigen.h"
#include "quant/scalar/fsq.h"
#include "quant/scalar/lfq.h"
#include "quanta.h"

namespace quanta::cli {
namespace {

using namespace quanta::quant;

// One train step of `step(x)` -> loss, with fresh gradients each time.
double time_step(const BenchOptions& o, Module& m, const Tensor& x,
                 const std::function<Tensor(const Tensor&)>& step) {
  return median_ms(o.repeat, [&] {
    m.zero_grad();
    x.zero_grad();
    step(x).backward();
  });
}

BenchRow bench_fsq(const BenchOptions& o, Generator& gen) {
  const int64_t B = o.small ? 2 : 8, N = o.small ? 64 : 1024, D = 256;
  FSQOptions opts;
  opts.levels = {8, 5, 5, 5};
  opts.dim = D;
  FSQ fsq(opts, gen);
  const Tensor x = randn({B, N, D}, gen).requires_grad_();
  const Tensor w = randn({B, N, D}, gen);
  BenchRow row{"fsq_train_step"};
  row.ms = time_step(
      o, fsq, x, [&](const Tensor& in) { return sum(fsq.forward(in, Tensor()).quantized * w); });
  const Tensor W_in = fsq.find("project_in.weight"), b_in = fsq.find("project_in.bias");
  const Tensor W_out = fsq.find("project_out.weight"), b_out = fsq.find("project_out.bias");
  row.floor_ms = time_step(o, fsq, x, [&](const Tensor& in) {
    return sum(linear(linear(in, W_in, b_in), W_out, b_out) * w);
  });
  return row;
}

BenchRow bench_lfq(const std::string& name, int64_t bits, int64_t B, int64_t N, double scale,
                   const BenchOptions& o, Generator& gen) {
  LFQOptions opts;
  opts.dim = bits;
  opts.entropy_loss_weight = 0.1;
  opts.commitment_loss_weight = 0.25;
  Generator same_seed = gen;  // both paths as one layer
  LFQ fast(opts, gen);
  opts.entropy_path = LFQEntropyPath::direct;
  LFQ direct(opts, same_seed);
  const Tensor x = (randn({B, N, bits}, gen) * scale).requires_grad_();
  const Tensor w = randn({B, N, bits}, gen);
  auto step = [&](LFQ& m) {
    return [&](const Tensor& in) {
      const QuantizeOutput out = m.forward(in, Tensor());
      return sum(out.quantized * w) + out.loss;
    };
  };
  BenchRow row{name};
  row.ms = time_step(o, fast, x, step(fast));
  row.floor_ms = time_step(o, direct, x, step(direct));
  return row;
}

}  // namespace

std::vector<BenchRow> bench_quant_scalar(const BenchOptions& o) {
  Generator gen(4321);
  std::vector<BenchRow> rows;
  rows.push_back(bench_fsq(o, gen));
  if (o.small) {
    rows.push_back(bench_lfq("lfq_1024_train_step", 10, 1, 64, 1.0, o, gen));
    rows.push_back(bench_lfq("lfq_65536_train_step", 12, 1, 16, 1.0, o, gen));
    rows.push_back(bench_lfq("lfq_65536_train_step_uniform", 12, 1, 16, 1e-4, o, gen));
  } else {
    rows.push_back(bench_lfq("lfq_1024_train_step", 10, 8, 1024, 1.0, o, gen));
    rows.push_back(bench_lfq("lfq_65536_train_step", 16, 1, 1024, 1.0, o, gen));
    rows.push_back(bench_lfq("lfq_65536_train_step_uniform", 16, 1, 1024, 1e-4, o, gen));
  }
  return rows;
}

}  // namespace quanta::cli
