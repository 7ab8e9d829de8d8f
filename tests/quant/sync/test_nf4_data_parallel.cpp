// NF4 + LoRA under DataParallel on real ranks: the frozen 4-bit base is
// broadcast from rank 0 as bytes (ranks built it from different weights),
// and training the adapters on N ranks with an uneven batch split equals one
// process on the whole batch.
#include <doctest/doctest.h>

#include <cstring>

#include "dist/data_parallel.h"
#include "dist/ranks.h"
#include "quant/nf4/nf4_modules.h"
#include "quanta.h"

using namespace quanta;
using namespace quanta::quant;
using dist::ProcessGroup;
using dist::testing::all_ok;
using dist::testing::run_ranks;

namespace {

constexpr int64_t kIn = 64, kHidden = 64, kOut = 4, kRows = 30;
constexpr int kSteps = 4;

/** An MLP whose Linear layers become NF4 bases with LoRA adapters; the base
 * weights come from `seed`, the adapters from a fixed seed. */
std::shared_ptr<Sequential> qlora_mlp(uint64_t seed) {
  Generator gen(seed);
  auto m = std::make_shared<Sequential>(std::make_shared<Linear>(kIn, kHidden, gen),
                                        std::make_shared<Tanh>(),
                                        std::make_shared<Linear>(kHidden, kOut, gen));
  NF4ConvertOptions o;
  o.lora = true;
  o.lora_options = {.rank = 4, .alpha = 8, .dropout = 0.0, .seed = 3};
  quantize_nf4(*m, o);
  // Start the adapters away from B = 0 so both A and B get gradients.
  for (auto& [name, p] : m->named_parameters())
    if (name.find("lora_B") != std::string::npos) {
      NoGradGuard no_grad;
      Generator bg(5);
      copy_(p, randn(p.shape(), bg) * 0.1);
    }
  return m;
}

Tensor inputs(int s) {
  Generator gen(100 + uint64_t(s));
  return randn({kRows, kIn}, gen);
}
Tensor targets(int s) {
  Generator gen(200 + uint64_t(s));
  return randn({kRows, kOut}, gen);
}

/** Rank r's share of the whole-batch mean squared error (sum convention). */
Tensor loss_share(Module& m, const Tensor& x, const Tensor& y, int world) {
  return sum(square(m.forward(x) - y)) * (double(world) / double(kRows * kOut));
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const Tensor c = contiguous(t);
  const auto* p = static_cast<const uint8_t*>(c.raw_data());
  return {p, p + c.nbytes()};
}

}  // namespace

TEST_CASE(
    "NF4 + LoRA under DataParallel: nf4 broadcast as bytes, N ranks "
    "equal one process") {
  // One process, rank 0's model, the whole batch.
  auto ref = qlora_mlp(11);
  SGD ref_opt(ref->parameters(), {.lr = 0.1});
  std::vector<double> ref_losses;
  for (int s = 0; s < kSteps; ++s) {
    Tensor loss = loss_share(*ref, inputs(s), targets(s), 1);
    ref_losses.push_back(loss.item());
    loss.backward();
    ref_opt.step();
    ref_opt.zero_grad();
  }
  const StateDict want = ref->state_dict();

  for (int n : {2, 3}) {
    CAPTURE(n);
    const std::vector<int64_t> cut =
        n == 2 ? std::vector<int64_t>{0, 21, kRows} : std::vector<int64_t>{0, 0, 13, kRows};
    std::vector<StateDict> got(static_cast<size_t>(n));
    std::vector<std::vector<double>> losses(static_cast<size_t>(n));
    std::vector<char> differed_before(static_cast<size_t>(n));
    const auto errors = run_ranks(n, [&](ProcessGroup& group) {
      const int r = group.rank();
      auto model = qlora_mlp(11 + uint64_t(r) * 1000);  // different bases per rank
      differed_before[size_t(r)] =
          bytes_of(model->find("0.base.weight")) != bytes_of(ref->find("0.base.weight"));
      dist::DataParallel dp(model, group);  // broadcasts rank 0's nf4 bytes
      SGD opt(model->parameters(), {.lr = 0.1});
      for (int s = 0; s < kSteps; ++s) {
        const Tensor x = contiguous(slice(inputs(s), 0, cut[size_t(r)], cut[size_t(r) + 1]));
        const Tensor y = contiguous(slice(targets(s), 0, cut[size_t(r)], cut[size_t(r) + 1]));
        Tensor loss = loss_share(*model, x, y, n);
        loss.backward();
        dp.finish_step();
        opt.step();
        opt.zero_grad();
        Tensor total = scalar(loss.item() / n, {.dtype = DType::f64});
        group.all_reduce(total);
        losses[size_t(r)].push_back(total.item());
      }
      got[size_t(r)] = model->state_dict();
    });
    REQUIRE(all_ok(errors));
    for (int r = 1; r < n; ++r) CHECK(differed_before[size_t(r)]);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      for (int s = 0; s < kSteps; ++s)
        CHECK(losses[size_t(r)][size_t(s)] == doctest::Approx(ref_losses[size_t(s)]).epsilon(1e-5));
      REQUIRE(got[size_t(r)].size() == want.size());
      for (std::size_t i = 0; i < want.size(); ++i) {
        const auto& [name, w] = want[i];
        const Tensor& g = got[size_t(r)][i].second;
        CAPTURE(name);
        REQUIRE(got[size_t(r)][i].first == name);
        CHECK(g.dtype() == w.dtype());
        // Every rank holds rank 0's bytes (nf4 bases: never re-quantized).
        CHECK(bytes_of(g) == bytes_of(got[0][i].second));
        if (w.dtype() == DType::nf4) {
          CHECK(bytes_of(g) == bytes_of(w));
        } else {
          CHECK(max(abs(to_dtype(g, DType::f64) - to_dtype(w, DType::f64))).item() <=
                1e-5 * std::max(1.0, max(abs(to_dtype(w, DType::f64))).item()));
        }
      }
    }
  }
}
