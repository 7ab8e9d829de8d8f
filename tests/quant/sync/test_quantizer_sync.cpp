// QuantizerSync on real ranks (threads over Gloo on loopback): N ranks with
// the global batch split unevenly (a rank with no tokens included) train to
// the same parameters, buffers and losses as one process on the whole batch,
// with every rank's state bitwise equal to the others'; and the misuse cases
// of docs/design.md (extra, eval, no-grad forwards, empty and fully masked
// batches, a rank that dies) end without a hang.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <set>

#include "dist/data_parallel.h"
#include "dist/ranks.h"
#include "quant/hierarchical/hierarchical_vq.h"
#include "quant/scalar/fsq.h"
#include "quant/scalar/lfq.h"
#include "quant/scalar/residual_fsq.h"
#include "quant/scalar/residual_lfq.h"
#include "quant/sync/quantizer_sync.h"
#include "quant/vq/residual_vq.h"
#include "quant/vq/vector_quantize.h"
#include "quanta.h"
#include "support/gpu.h"

using namespace quanta;
using namespace quanta::quant;
using dist::ProcessGroup;
using dist::testing::all_ok;
using dist::testing::run_ranks;

namespace {

constexpr int64_t kDim = 6;
constexpr int64_t kTokens = 40;  // global batch per step
constexpr int kSteps = 5;

using QuantizeFn = std::function<QuantizeOutput(Module&, const Tensor& x, const Tensor& mask)>;

/** A quantizer under test: how to build it and call it. */
struct Case {
  std::string name;
  std::function<std::shared_ptr<Module>(Generator&)> make;
  QuantizeFn quantize;
  /** The layer's loss is already a whole-batch quantity on every rank (LFQ in
   * distributed mode); otherwise it is a local token mean. */
  bool global_loss = false;
  /** Feed the tokens as a batch of length-1 sequences [T, 1, D] instead of
   * one sequence [1, T, D] (the diversity loss averages over the batch per
   * sequence position, so positions must be the same on every rank). */
  bool tokens_as_batch = false;
};

template <class Layer>
QuantizeFn call() {
  return [](Module& m, const Tensor& x, const Tensor& mask) {
    return dynamic_cast<Layer&>(m).forward(x, mask);
  };
}

VectorQuantizeOptions vq_options() {
  VectorQuantizeOptions o;
  o.dim = kDim;
  o.codebook_size = 8;
  o.codebook_dim = 4;
  o.decay = 0.8;
  return o;
}

/** A ResidualVQ of 3 levels of 8 codes over vq_options() layers. */
ResidualVQOptions rvq_options() {
  ResidualVQOptions o;
  o.dim = kDim;
  o.num_quantizers = 3;
  o.codebook_sizes = {8};
  o.layer = vq_options();
  return o;
}

std::vector<Case> cases();

Case case_named(const std::string& name) {
  for (Case& c : cases())
    if (c.name == name) return c;
  throw std::invalid_argument("no test case " + name);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  out.push_back({"vq_kmeans_dead_codes",
                 [](Generator& g) {
                   auto o = vq_options();
                   o.kmeans_init = true;
                   o.kmeans_iters = 4;
                   o.threshold_ema_dead_code = 1.0;
                   return std::make_shared<VectorQuantize>(o, g);
                 },
                 call<VectorQuantize>()});
  out.push_back({"vq_cosine_dead_codes",
                 [](Generator& g) {
                   auto o = vq_options();
                   o.use_cosine_sim = true;
                   o.threshold_ema_dead_code = 1.0;
                   return std::make_shared<VectorQuantize>(o, g);
                 },
                 call<VectorQuantize>()});
  out.push_back({"vq_every_code_expires",
                 [](Generator& g) {
                   auto o = vq_options();
                   o.threshold_ema_dead_code = 1e6;
                   return std::make_shared<VectorQuantize>(o, g);
                 },
                 call<VectorQuantize>()});
  out.push_back({"vq_codebook_diversity",
                 [](Generator& g) {
                   auto o = vq_options();
                   o.commitment_weight = 0;  // the loss is then all whole-batch
                   o.codebook_diversity_loss_weight = 0.5;
                   o.threshold_ema_dead_code = 1.0;
                   return std::make_shared<VectorQuantize>(o, g);
                 },
                 call<VectorQuantize>(), true, true});
  out.push_back({"vq_affine_param",
                 [](Generator& g) {
                   auto o = vq_options();
                   o.affine_param = true;
                   o.threshold_ema_dead_code = 1.0;
                   return std::make_shared<VectorQuantize>(o, g);
                 },
                 call<VectorQuantize>()});
  out.push_back({"rvq_quantize_dropout",
                 [](Generator& g) {
                   ResidualVQOptions o = rvq_options();
                   o.quantize_dropout = true;
                   o.layer.threshold_ema_dead_code = 0.5;
                   return std::make_shared<ResidualVQ>(o, g);
                 },
                 call<ResidualVQ>()});
  // A codebook shared by the levels is called once per level: its k-means
  // samples and dead-code candidates are pooled level by level across the
  // ranks, as one process holds them.
  out.push_back({"rvq_shared_codebook_kmeans_dead_codes",
                 [](Generator& g) {
                   ResidualVQOptions o = rvq_options();
                   o.shared_codebook = true;
                   o.layer.kmeans_init = true;
                   o.layer.kmeans_iters = 4;
                   o.layer.threshold_ema_dead_code = 1.0;
                   return std::make_shared<ResidualVQ>(o, g);
                 },
                 call<ResidualVQ>()});
  out.push_back({"fsq_projected",
                 [](Generator& g) {
                   FSQOptions o;
                   o.levels = {5, 4, 3};
                   o.dim = kDim;
                   return std::make_shared<FSQ>(o, g);
                 },
                 call<FSQ>()});
  out.push_back({"rfsq_quantize_dropout",
                 [](Generator& g) {
                   ResidualFSQOptions o;
                   o.fsq.levels = {5, 4, 3};
                   o.fsq.dim = kDim;
                   o.num_quantizers = 3;
                   o.quantize_dropout = true;
                   return std::make_shared<ResidualFSQ>(o, g);
                 },
                 call<ResidualFSQ>()});
  auto lfq_options = [] {
    LFQOptions o;
    o.dim = kDim;
    o.codebook_size = 16;
    o.entropy_loss_weight = 0.1;
    o.commitment_loss_weight = 0.25;
    return o;
  };
  out.push_back({"lfq_entropy",
                 [lfq_options](Generator& g) { return std::make_shared<LFQ>(lfq_options(), g); },
                 [](Module& m, const Tensor& x, const Tensor& mask) {
                   return dynamic_cast<LFQ&>(m).forward(x, mask);
                 },
                 true});
  out.push_back({"rlfq_quantize_dropout",
                 [lfq_options](Generator& g) {
                   ResidualLFQOptions o;
                   o.lfq = lfq_options();
                   o.num_quantizers = 2;
                   o.quantize_dropout = true;
                   return std::make_shared<ResidualLFQ>(o, g);
                 },
                 [](Module& m, const Tensor& x, const Tensor& mask) {
                   return dynamic_cast<ResidualLFQ&>(m).forward(x, mask);
                 },
                 true});
  // DiVeQ's direction noise is drawn per rank for its own tokens (like
  // stochastic sampling): without noise the rest of the path, codes trained
  // by gradient and dead-code statistics, is N ranks == one process.
  out.push_back({"vq_diveq",
                 [](Generator& g) {
                   auto o = vq_options();
                   o.directional_reparam = true;
                   o.directional_reparam_variance = 0;
                   o.threshold_ema_dead_code = 1.0;
                   return std::make_shared<VectorQuantize>(o, g);
                 },
                 call<VectorQuantize>()});
  out.push_back({"rvq_diveq",
                 [](Generator& g) {
                   ResidualVQOptions o;
                   o.dim = kDim;
                   o.num_quantizers = 2;
                   o.codebook_sizes = {8};
                   o.diveq = true;
                   o.layer.directional_reparam_variance = 0;
                   o.layer.threshold_ema_dead_code = 1.0;
                   return std::make_shared<ResidualVQ>(o, g);
                 },
                 call<ResidualVQ>()});
  // The codebook transform: a bridge over the codes, and QINCo's per-token
  // codebooks (an MLP of each code and the token's running sum), both
  // trained by gradient; no collective in their forwards.
  out.push_back({"vq_bridge",
                 [](Generator& g) {
                   auto o = vq_options();
                   o.vq_bridge = std::make_shared<Sequential>(std::make_shared<Linear>(4, 4, g),
                                                              std::make_shared<Tanh>());
                   o.threshold_ema_dead_code = 1.0;
                   return std::make_shared<VectorQuantize>(o, g);
                 },
                 call<VectorQuantize>()});
  out.push_back({"rvq_implicit_neural_codebook",
                 [](Generator& g) {
                   ResidualVQOptions o;
                   o.dim = kDim;
                   o.codebook_dim = 4;
                   o.num_quantizers = 3;
                   o.codebook_sizes = {8};
                   o.implicit_neural_codebook = true;
                   o.mlp_depth = 1;
                   o.layer.threshold_ema_dead_code = 1.0;
                   return std::make_shared<ResidualVQ>(o, g);
                 },
                 call<ResidualVQ>()});
  return out;
}

/** An encoder and the quantizer: every rank builds it from the same seed. */
struct Net : Module {
  std::shared_ptr<Linear> enc;
  std::shared_ptr<Module> q;
  Net(const Case& c, uint64_t seed) : Module("Net") {
    Generator gen(seed);
    enc = register_module("enc", std::make_shared<Linear>(kDim, kDim, gen));
    q = register_module("q", c.make(gen));
    // f64, so that "equal to one process" can be checked far below the
    // quantizers' f32 sensitivity (the only differences left are summation
    // orders across ranks).
    to(DType::f64);
  }
};

/** The global batch of step s: [kTokens, kDim], the same on every rank. */
Tensor global_batch(int s) {
  Generator gen(1000 + uint64_t(s));
  return to_dtype(randn({kTokens, kDim}, gen) * 1.5, DType::f64);
}

/** Rows [begin, end) of each rank: uneven, with empty ranks for N > 2. */
std::vector<int64_t> cuts(int n) {
  switch (n) {
    case 1:
      return {0, kTokens};
    case 2:
      return {0, 28, kTokens};
    case 3:
      return {0, 25, kTokens, kTokens};  // rank 2 has no tokens
    default:
      return {0, 10, 10, 29, kTokens};  // rank 1 has no tokens
  }
}

/** One training forward and backward on `x` (this rank's rows), with the
 * loss scaled so that the sum over ranks is the whole-batch loss (the sum
 * convention of dist::fn; DataParallel's averaging then gives the
 * whole-batch gradient). Returns this rank's share of the loss. */
double forward_backward(Net& net, const Case& c, const Tensor& x, int world, bool backward = true,
                        const Tensor& mask = Tensor()) {
  const int64_t t = x.size(0);
  Tensor z = net.enc->forward(x);
  const Shape tokens = c.tokens_as_batch ? Shape{t, 1, kDim} : Shape{1, t, kDim};
  const Tensor m = mask.defined() ? reshape(mask, {tokens[0], tokens[1]}) : mask;
  QuantizeOutput out = c.quantize(*net.q, reshape(z, tokens), m);
  Tensor q = reshape(out.quantized, {t, kDim});
  // Sums over this rank's tokens divided by the GLOBAL count: no 0/0 for an
  // empty rank, and the ranks' shares add up to the whole-batch mean.
  Tensor loss = sum(square(q - x)) * (double(world) / double(kTokens * kDim));
  const double aux_scale = c.global_loss ? 1.0 : double(world) * double(t) / double(kTokens);
  loss = loss + sum(out.loss) * aux_scale;
  if (backward && loss.requires_grad()) loss.backward();
  return loss.item() / double(world);
}

using State = std::map<std::string, std::vector<double>>;

State state_of(Module& m) {
  State s;
  for (auto& [name, t] : m.state_dict()) s[name] = to_dtype(t, DType::f64).to_vector<double>();
  return s;
}

/** One process, the whole batch: the reference the ranks must equal. */
std::pair<State, std::vector<double>> train_one_process(const Case& c) {
  auto group = ProcessGroup::single();
  auto net = std::make_shared<Net>(c, 7);
  QuantizerSync sync(net, *group);
  SGD opt(net->parameters(), {.lr = 0.05});
  std::vector<double> losses;
  for (int s = 0; s < kSteps; ++s) {
    losses.push_back(forward_backward(*net, c, global_batch(s), 1));
    sync.sync_state();
    opt.step();
    opt.zero_grad();
  }
  return {state_of(*net), losses};
}

double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0, scale = 1e-30;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return diff / scale;
}

bool bitwise_equal(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

}  // namespace

TEST_CASE(
    "QuantizerSync: N ranks with uneven (and empty) batches equal one "
    "process") {
  for (const Case& c : cases()) {
    const auto [want, want_losses] = train_one_process(c);
    for (int n : {2, 3, 4}) {
      CAPTURE(c.name);
      CAPTURE(n);
      std::vector<State> got(static_cast<size_t>(n));
      std::vector<std::vector<double>> losses(static_cast<size_t>(n));
      const auto errors = run_ranks(n, [&](ProcessGroup& group) {
        const int r = group.rank();
        auto net = std::make_shared<Net>(c, 7);
        QuantizerSync sync(net, group);
        dist::DataParallel dp(net, group, {.broadcast_buffers = false});
        sync.attach(dp);
        SGD opt(net->parameters(), {.lr = 0.05});
        const auto cut = cuts(n);
        for (int s = 0; s < kSteps; ++s) {
          const Tensor x = slice(global_batch(s), 0, cut[size_t(r)], cut[size_t(r) + 1]);
          Tensor share = scalar(forward_backward(*net, c, contiguous(x), n), {.dtype = DType::f64});
          dp.finish_step();  // gradients, then sync_state()
          opt.step();
          opt.zero_grad();
          group.all_reduce(share);
          losses[size_t(r)].push_back(share.item());
        }
        got[size_t(r)] = state_of(*net);
      });
      REQUIRE(all_ok(errors));
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        for (int s = 0; s < kSteps; ++s)
          CHECK(losses[size_t(r)][size_t(s)] ==
                doctest::Approx(want_losses[size_t(s)]).epsilon(1e-9));
        REQUIRE(got[size_t(r)].size() == want.size());
        for (const auto& [name, values] : want) {
          CAPTURE(name);
          // Equal to one process within float tolerance (reduction order)...
          CHECK(max_rel_diff(got[size_t(r)].at(name), values) <= 1e-9);
          // ...and bitwise equal across ranks.
          CHECK(bitwise_equal(got[size_t(r)].at(name), got[0].at(name)));
        }
      }
    }
  }
}

namespace {

/** The codebook state (every buffer) of a net, for bitwise comparisons. */
State buffers_of(Module& m) {
  State s;
  for (auto& [name, t] : m.named_buffers()) s[name] = to_dtype(t, DType::f64).to_vector<double>();
  return s;
}

/** Residual levels kept in a training forward: the count of layers whose
 * index is not -1 for token 0. */
int64_t kept_levels(const Tensor& indices) {
  const std::vector<int64_t> idx = to_dtype(indices, DType::i64).to_vector<int64_t>();
  const int64_t q = indices.size(-1);
  int64_t kept = 0;
  for (int64_t i = 0; i < q; ++i) kept += idx[size_t(i)] >= 0;
  return kept;
}

}  // namespace

TEST_CASE(
    "QuantizerSync: extra, eval, no-grad and fully masked forwards on "
    "some ranks") {
  // Rank 0 runs an extra training forward every step; rank 1 evaluates (even
  // steps) or runs under no-grad (odd steps) and never calls backward; rank 2
  // sends a fully masked batch. None of it may hang or split the codebooks.
  for (const Case& c : cases()) {
    if (c.global_loss) continue;  // LFQ's loss is collective: see the next test
    CAPTURE(c.name);
    constexpr int n = 3;
    std::vector<State> buffers(n);
    std::vector<uint64_t> sequence(n);
    std::vector<std::vector<int64_t>> kept(n);
    const auto errors = run_ranks(n, [&](ProcessGroup& group) {
      const int r = group.rank();
      auto net = std::make_shared<Net>(c, 7);
      QuantizerSync sync(net, group);
      dist::DataParallel dp(net, group, {.broadcast_buffers = false});
      sync.attach(dp);
      SGD opt(net->parameters(), {.lr = 0.05});
      for (int s = 0; s < kSteps; ++s) {
        const Tensor x = contiguous(slice(global_batch(s), 0, r * 12, r * 12 + 12));
        const Tensor tokens = reshape(x, {1, 12, kDim});
        if (r == 0) c.quantize(*net->q, tokens, Tensor());  // the extra forward
        if (r == 1 && s % 2 == 0) {
          net->eval();
          c.quantize(*net->q, tokens, Tensor());
          net->train();
        } else if (r == 1) {
          NoGradGuard no_grad;
          c.quantize(*net->q, tokens, Tensor());
        } else {
          const Tensor mask = r == 2 ? zeros({1, 12}, {.dtype = DType::boolean}) : Tensor();
          const QuantizeOutput out = c.quantize(*net->q, tokens, mask);
          if (r == 0 && out.indices.dim() == 3) kept[size_t(r)].push_back(kept_levels(out.indices));
          forward_backward(*net, c, x, n, true, mask);
        }
        dp.finish_step();
        opt.step();
        opt.zero_grad();
      }
      buffers[size_t(r)] = buffers_of(*net);
      sequence[size_t(r)] = group.sequence();
    });
    REQUIRE(all_ok(errors));
    for (int r = 1; r < n; ++r) {
      CAPTURE(r);
      CHECK(sequence[size_t(r)] == sequence[0]);  // the same collectives everywhere
      for (const auto& [name, values] : buffers[0]) {
        CAPTURE(name);
        CHECK(bitwise_equal(buffers[size_t(r)].at(name), values));
      }
    }
  }
}

TEST_CASE("QuantizerSync: quantize dropout draws the same level on every rank") {
  // Each rank runs a different number of extra training forwards per step:
  // the level kept in the step's real forward is the same on every rank.
  const Case c = case_named("rvq_quantize_dropout");
  constexpr int n = 3;
  std::vector<std::vector<int64_t>> kept(n);
  const auto errors = run_ranks(n, [&](ProcessGroup& group) {
    const int r = group.rank();
    auto net = std::make_shared<Net>(c, 7);
    QuantizerSync sync(net, group);
    for (int s = 0; s < 8; ++s) {
      const Tensor tokens = reshape(global_batch(s), {1, kTokens, kDim});
      for (int extra = 0; extra < r; ++extra) c.quantize(*net->q, tokens, Tensor());
      kept[size_t(r)].push_back(kept_levels(c.quantize(*net->q, tokens, Tensor()).indices));
      sync.sync_state();
    }
  });
  REQUIRE(all_ok(errors));
  CHECK(kept[1] == kept[0]);
  CHECK(kept[2] == kept[0]);
  // And the draws do change from step to step (3 levels, 8 steps).
  CHECK(std::set<int64_t>(kept[0].begin(), kept[0].end()).size() > 1);
}

TEST_CASE("QuantizerSync on one process and a device: the steady state reads nothing back") {
  // k-means, affine statistics, EMA and dead codes through the deferred
  // path: after the first reconciliation (k-means) every step is queued on
  // the device, and ends with the CPU's codebook bit for bit.
  auto o = vq_options();
  o.kmeans_init = true;
  o.affine_param = true;
  o.threshold_ema_dead_code = 1.0;
  std::vector<std::vector<std::vector<float>>> results;
  std::vector<Device> devices{Device::cpu()};
  for (const Device d : quanta::testing::test_devices()) devices.push_back(d);
  for (const Device device : devices) {
    CAPTURE(device.str());
    auto group = ProcessGroup::single();
    Generator gen(11);
    auto vq = std::make_shared<VectorQuantize>(o, gen);
    vq->to(device);
    QuantizerSync sync(vq, *group);
    auto step = [&](int64_t s) {
      const Tensor x = reshape(global_batch(int(s)), {1, kTokens, kDim})
                           .to(DType::f32)
                           .to(device)
                           .requires_grad_(true);
      const QuantizeOutput out = vq->forward(x, Tensor());
      (sum(out.quantized) + sum(out.loss)).backward();
      sync.sync_state();
    };
    step(0);  // k-means on the first batch's samples
    if (!device.is_cpu()) {
      HostSyncGuard guard("QuantizerSync's steady state on one process");
      for (int64_t s = 1; s < kSteps; ++s) step(s);
    } else {
      for (int64_t s = 1; s < kSteps; ++s) step(s);
    }
    std::vector<std::vector<float>> state;
    for (const auto& [name, t] : vq->named_buffers())
      state.push_back(t.to(Device::cpu()).to(DType::f32).to_vector<float>());
    results.push_back(state);
  }
  // sim runs the CPU's kernels (the same bits); a GPU's sums add in other
  // orders, so its buffers are the CPU's within rounding.
  for (std::size_t i = 1; i < results.size(); ++i) {
    CAPTURE(devices[i].str());
    if (devices[i].is_sim()) {
      CHECK(results[i] == results[0]);
      continue;
    }
    REQUIRE(results[i].size() == results[0].size());
    for (std::size_t b = 0; b < results[0].size(); ++b) {
      REQUIRE(results[i][b].size() == results[0][b].size());
      double worst = 0, scale = 1;
      for (std::size_t j = 0; j < results[0][b].size(); ++j) {
        worst = std::max(worst, double(std::abs(results[i][b][j] - results[0][b][j])));
        scale = std::max(scale, double(std::abs(results[0][b][j])));
      }
      CHECK(worst < 1e-4 * scale);
    }
  }
}

TEST_CASE("QuantizerSync: k-means waits for the first reconciliation") {
  const Case c = cases()[0];
  REQUIRE(c.name == "vq_kmeans_dead_codes");
  auto group = ProcessGroup::single();
  auto net = std::make_shared<Net>(c, 7);
  QuantizerSync sync(net, *group);
  auto& vq = dynamic_cast<VectorQuantize&>(*net->q);
  const Tensor tokens = reshape(global_batch(0), {1, kTokens, kDim});
  // Before: the zero codebook, every token on code 0, samples kept.
  QuantizeOutput first = vq.forward(tokens, Tensor());
  CHECK_FALSE(vq.codebook().initted());
  CHECK(max(abs(vq.codebook().embed())).item() == 0.0);
  CHECK(max(first.indices).item() == 0.0);
  sync.sync_state();
  CHECK(vq.codebook().initted());
  CHECK(max(abs(vq.codebook().embed())).item() > 0.0);
  // After: real codes, several in use.
  const Tensor idx = vq.forward(tokens, Tensor()).indices;
  CHECK(max(idx).item() > 0.0);
}

TEST_CASE(
    "QuantizerSync: a rank that dies mid-step makes the others fail "
    "naming it") {
  const Case c = cases()[0];
  dist::GroupOptions opts;
  opts.timeout = dist::Millis(2000);
  const auto errors = run_ranks(
      3,
      [&](ProcessGroup& group) {
        auto net = std::make_shared<Net>(c, 7);
        QuantizerSync sync(net, group);
        dist::DataParallel dp(net, group, {.broadcast_buffers = false});
        sync.attach(dp);
        const Tensor x = contiguous(slice(global_batch(0), 0, 0, 12));
        forward_backward(*net, c, x, 3);
        if (group.rank() == 1) throw std::runtime_error("rank 1 crashed");
        dp.finish_step();
      },
      opts);
  CHECK(errors[1] == "rank 1 crashed");
  for (int r : {0, 2}) {
    CAPTURE(errors[size_t(r)]);
    CHECK(errors[size_t(r)].find("rank 1") != std::string::npos);
  }
}

TEST_CASE(
    "QuantizerSync: an LFQ rank evaluating while the others train fails "
    "on every rank") {
  // LFQ's loss holds collectives (global token means): a rank that skips
  // them cannot be made correct, but it must fail clearly, not hang.
  const Case c = case_named("lfq_entropy");
  dist::GroupOptions opts;
  opts.timeout = dist::Millis(2000);
  const auto errors = run_ranks(
      2,
      [&](ProcessGroup& group) {
        auto net = std::make_shared<Net>(c, 7);
        QuantizerSync sync(net, group);
        dist::DataParallel dp(net, group, {.broadcast_buffers = false});
        sync.attach(dp);
        const Tensor x = contiguous(slice(global_batch(0), 0, 0, 12));
        if (group.rank() == 1) net->eval();
        forward_backward(*net, c, x, 2);
        dp.finish_step();
      },
      opts);
  // Each rank waits in a different collective (rank 0 in LFQ's global mean,
  // rank 1 in DataParallel's gradient bucket) and fails naming it and the
  // other rank.
  for (int r : {0, 1}) {
    CAPTURE(r);
    CAPTURE(errors[size_t(r)]);
    CHECK(errors[size_t(r)].find("all_reduce") != std::string::npos);
    // The other rank is named: still away, or already failed and gone.
    const std::string other = std::to_string(1 - r);
    CHECK((errors[size_t(r)].find("ranks that did not arrive: " + other) != std::string::npos ||
           errors[size_t(r)].find("rank " + other + " left the group") != std::string::npos));
  }
}

TEST_CASE("QuantizerSync: collectives per reconciliation, whatever expires") {
  // Steady state: one fused all_reduce (header, counts, sums); a second one
  // carries the replacement rows whenever expiry is on and some rank holds
  // candidates (which codes expire is the device's business, not a reason
  // to read it back). No statistics anywhere: still the one fused
  // all_reduce (of zeros). k-means pending: one all_gather_v per table,
  // nothing else.
  const auto errors = run_ranks(2, [&](ProcessGroup& group) {
    Generator gen(3);
    auto o = vq_options();
    o.threshold_ema_dead_code = 1e9;  // every code expires every step
    auto vq = std::make_shared<VectorQuantize>(o, gen);
    QuantizerSync sync(vq, group);
    Generator data(40 + uint64_t(group.rank()));
    const Tensor x = randn({1, 7, kDim}, data);
    for (int s = 0; s < 3; ++s) {
      vq->forward(x);
      const uint64_t before = group.sequence();
      sync.sync_state();
      CHECK(group.sequence() - before == 2);
      CHECK(any(vq->codebook().expired_codes()).item() == 0.0);  // all were replaced
    }
    const uint64_t before = group.sequence();
    sync.sync_state();  // no forward since the last one
    CHECK(group.sequence() - before == 1);

    auto rare = vq_options();
    rare.threshold_ema_dead_code = 1e-9;  // on, but no code falls below it
    auto vq1 = std::make_shared<VectorQuantize>(rare, gen);
    QuantizerSync sync1(vq1, group);
    vq1->forward(x);
    const uint64_t start = group.sequence();
    sync1.sync_state();
    CHECK(group.sequence() - start == 2);  // the same sequence, nothing read to skip it
    CHECK(any(vq1->codebook().expired_codes()).item() == 0.0);

    auto steady = vq_options();
    steady.threshold_ema_dead_code = 0;  // codes never expire
    steady.affine_param = true;
    auto vq2 = std::make_shared<VectorQuantize>(steady, gen);
    QuantizerSync sync2(vq2, group);
    for (int s = 0; s < 2; ++s) {
      vq2->forward(x);
      const uint64_t at = group.sequence();
      sync2.sync_state();
      CHECK(group.sequence() - at == 1);
    }

    auto ko = vq_options();
    ko.kmeans_init = true;
    ko.heads = 2;
    ko.separate_codebook_per_head = true;
    auto fresh = std::make_shared<VectorQuantize>(ko, gen);
    QuantizerSync init_sync(fresh, group);
    fresh->forward(randn({1, 7, kDim}, data));
    const uint64_t at = group.sequence();
    init_sync.sync_state();
    CHECK(group.sequence() - at == 2);  // one all_gather_v per table
    fresh->forward(randn({1, 7, kDim}, data));
    const uint64_t next = group.sequence();
    init_sync.sync_state();
    CHECK(group.sequence() - next == 1);  // initialised: the fused all_reduce

    // A codebook shared by 3 levels pools its samples level by level: one
    // all_gather_v per level, whatever the data.
    ResidualVQOptions shared = rvq_options();
    shared.shared_codebook = true;
    shared.layer.kmeans_init = true;
    auto rvq = std::make_shared<ResidualVQ>(shared, gen);
    QuantizerSync rvq_sync(rvq, group);
    REQUIRE(rvq_sync.num_codebooks() == 1);
    rvq->forward(randn({1, 7, kDim}, data));
    const uint64_t levels = group.sequence();
    rvq_sync.sync_state();
    CHECK(group.sequence() - levels == 3);
  });
  REQUIRE(all_ok(errors));
}

namespace {

// HierarchicalVQ: images [B, kDim, 4, 4] quantized at scales 1, 2, 4, the
// global batch of kImages split by whole images (a rank with none for N = 3).
constexpr int64_t kImages = 6;
constexpr int64_t kSide = 4;

HierarchicalVQOptions hvq_options(bool shared) {
  HierarchicalVQOptions o;
  o.dim = kDim;
  o.codebook_size = {8};
  o.scales = {{1}, {2}, {4}};
  o.shared_codebook = shared;
  o.share_quant_resi = shared ? 1 : 0;  // one Phi, or one per level
  o.accept_image_fmap = true;
  o.layer.decay = 0.8;
  o.layer.kmeans_init = true;
  o.layer.kmeans_iters = 4;
  o.layer.threshold_ema_dead_code = 1.0;
  o.nested_dropout = 0.7;  // most steps keep fewer levels: the cutoff matters
  return o;
}

std::shared_ptr<HierarchicalVQ> make_hvq(const HierarchicalVQOptions& o) {
  Generator gen(7);
  auto hvq = std::make_shared<HierarchicalVQ>(o, gen);
  hvq->to(DType::f64);
  return hvq;
}

Tensor global_images(int s) {
  Generator gen(2000 + uint64_t(s));
  return to_dtype(randn({kImages, kDim, kSide, kSide}, gen) * 1.5, DType::f64);
}

std::vector<int64_t> image_cuts(int n) {
  if (n == 1) return {0, kImages};
  if (n == 2) return {0, 4, kImages};
  return {0, 3, kImages, kImages};  // rank 2 has no images
}

/** A training forward and backward on this rank's images, scaled as
 * forward_backward() does (the ranks' shares add up to the whole-batch
 * loss: every level's commitment loss is a mean over the rank's images).
 * Returns this rank's share; `cutoff` gets the forward's nested-dropout cutoff. */
double hvq_forward_backward(HierarchicalVQ& hvq, const Tensor& x, int world, int64_t& cutoff) {
  const QuantizeOutput out = hvq.forward(x);
  cutoff = hvq.last_cutoff();
  const double all = double(kImages * kDim * kSide * kSide);
  Tensor loss = sum(square(out.quantized - x)) * (double(world) / all);
  loss = loss + out.loss * (double(world) * double(x.size(0)) / double(kImages));
  if (loss.requires_grad()) loss.backward();
  return loss.item() / double(world);
}

std::vector<double> grads_of(Module& m) {
  std::vector<double> g;
  for (auto& [name, p] : m.named_parameters()) {
    // A level's Phi past the step's cutoff has no gradient on one process
    // (DataParallel fills zeros): compare it as zeros.
    const Tensor grad = p.grad().defined() ? p.grad() : zeros_like(p);
    const std::vector<double> v = to_dtype(grad, DType::f64).to_vector<double>();
    g.insert(g.end(), v.begin(), v.end());
  }
  return g;
}

struct HvqRun {
  State state;
  std::vector<double> losses;
  std::vector<std::vector<double>> grads;  // per step, after the reduction
  std::vector<int64_t> cutoffs;
};

}  // namespace

TEST_CASE("QuantizerSync: HierarchicalVQ on N ranks equals one process") {
  // A shared codebook is called once per level: its k-means and dead-code
  // pools hold level 0 of every rank's images, then level 1, ..., as one
  // process holds them. Both forms also run with every code expiring every
  // step, so that the replacement pool is surely drawn from.
  struct Variant {
    bool shared;
    double threshold;
  };
  for (const Variant v :
       {Variant{false, 1.0}, Variant{false, 1e6}, Variant{true, 1.0}, Variant{true, 1e6}}) {
    const bool shared = v.shared;
    CAPTURE(shared);
    CAPTURE(v.threshold);
    HierarchicalVQOptions o = hvq_options(shared);
    o.layer.threshold_ema_dead_code = v.threshold;
    HvqRun want;
    {
      auto group = ProcessGroup::single();
      auto hvq = make_hvq(o);
      QuantizerSync sync(hvq, *group);
      SGD opt(hvq->parameters(), {.lr = 0.05});
      for (int s = 0; s < kSteps; ++s) {
        int64_t cutoff = 0;
        want.losses.push_back(hvq_forward_backward(*hvq, global_images(s), 1, cutoff));
        want.cutoffs.push_back(cutoff);
        want.grads.push_back(grads_of(*hvq));
        sync.sync_state();
        opt.step();
        opt.zero_grad();
      }
      want.state = state_of(*hvq);
    }
    // The draws vary from step to step, and some steps drop levels.
    CHECK(std::set<int64_t>(want.cutoffs.begin(), want.cutoffs.end()).size() > 1);
    for (int n : {2, 3}) {
      CAPTURE(n);
      std::vector<HvqRun> got(static_cast<size_t>(n));
      const auto errors = run_ranks(n, [&](ProcessGroup& group) {
        const int r = group.rank();
        HvqRun& run = got[size_t(r)];
        auto hvq = make_hvq(o);
        QuantizerSync sync(hvq, group);
        dist::DataParallel dp(hvq, group, {.broadcast_buffers = false});
        sync.attach(dp);
        SGD opt(hvq->parameters(), {.lr = 0.05});
        const auto cut = image_cuts(n);
        for (int s = 0; s < kSteps; ++s) {
          const Tensor x =
              contiguous(slice(global_images(s), 0, cut[size_t(r)], cut[size_t(r) + 1]));
          int64_t cutoff = 0;
          Tensor share = scalar(hvq_forward_backward(*hvq, x, n, cutoff), {.dtype = DType::f64});
          run.cutoffs.push_back(cutoff);
          dp.finish_step();  // gradients, then sync_state()
          run.grads.push_back(grads_of(*hvq));
          opt.step();
          opt.zero_grad();
          group.all_reduce(share);
          run.losses.push_back(share.item());
        }
        run.state = state_of(*hvq);
      });
      REQUIRE(all_ok(errors));
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        const HvqRun& run = got[size_t(r)];
        CHECK(run.cutoffs == want.cutoffs);
        for (int s = 0; s < kSteps; ++s) {
          CAPTURE(s);
          CHECK(run.losses[size_t(s)] == doctest::Approx(want.losses[size_t(s)]).epsilon(1e-9));
          REQUIRE(run.grads[size_t(s)].size() == want.grads[size_t(s)].size());
          CHECK(max_rel_diff(run.grads[size_t(s)], want.grads[size_t(s)]) <= 1e-9);
        }
        REQUIRE(run.state.size() == want.state.size());
        for (const auto& [name, values] : want.state) {
          CAPTURE(name);
          CHECK(max_rel_diff(run.state.at(name), values) <= 1e-9);
          CHECK(bitwise_equal(run.state.at(name), got[0].state.at(name)));
        }
      }
    }
  }
}

TEST_CASE("QuantizerSync: a HierarchicalVQ rank validating in train mode does not hang") {
  // The reference draws the nested-dropout cutoff from a seed made by a
  // collective inside the forward, so a rank that runs a train-mode forward
  // alone (validation without eval()) waits there forever. Here the cutoff
  // comes from the step-pinned stream: rank 1 validates every step (plain
  // and under no-grad), rank 0 does not, and both go on in step.
  for (const bool shared : {false, true}) {
    CAPTURE(shared);
    constexpr int n = 2;
    std::vector<State> buffers(n);
    std::vector<uint64_t> sequence(n);
    std::vector<std::vector<int64_t>> cutoffs(n), validation_cutoffs(n);
    dist::GroupOptions opts;
    opts.timeout = dist::Millis(20000);  // a collective in the forward fails, never hangs
    const auto errors = run_ranks(
        n,
        [&](ProcessGroup& group) {
          const int r = group.rank();
          auto hvq = make_hvq(hvq_options(shared));
          QuantizerSync sync(hvq, group);
          dist::DataParallel dp(hvq, group, {.broadcast_buffers = false});
          sync.attach(dp);
          SGD opt(hvq->parameters(), {.lr = 0.05});
          const auto cut = image_cuts(n);
          for (int s = 0; s < kSteps; ++s) {
            const Tensor x =
                contiguous(slice(global_images(s), 0, cut[size_t(r)], cut[size_t(r) + 1]));
            if (r == 1) {
              const Tensor val = global_images(100 + s);
              hvq->forward(val);  // still in train mode, no backward
              validation_cutoffs[size_t(r)].push_back(hvq->last_cutoff());
              NoGradGuard no_grad;
              hvq->forward(val);
              validation_cutoffs[size_t(r)].push_back(hvq->last_cutoff());
            }
            int64_t cutoff = 0;
            hvq_forward_backward(*hvq, x, n, cutoff);
            cutoffs[size_t(r)].push_back(cutoff);
            dp.finish_step();
            opt.step();
            opt.zero_grad();
          }
          buffers[size_t(r)] = buffers_of(*hvq);
          sequence[size_t(r)] = group.sequence();
        },
        opts);
    REQUIRE(all_ok(errors));
    CHECK(sequence[1] == sequence[0]);  // the same collectives on both ranks
    // The same cutoff for every forward of a step, on either rank.
    CHECK(cutoffs[1] == cutoffs[0]);
    REQUIRE(validation_cutoffs[1].size() == 2 * size_t(kSteps));
    for (int s = 0; s < kSteps; ++s) {
      CHECK(validation_cutoffs[1][2 * size_t(s)] == cutoffs[0][size_t(s)]);
      CHECK(validation_cutoffs[1][2 * size_t(s) + 1] == cutoffs[0][size_t(s)]);
    }
    CHECK(std::set<int64_t>(cutoffs[0].begin(), cutoffs[0].end()).size() > 1);
    for (const auto& [name, values] : buffers[0]) {
      CAPTURE(name);
      CHECK(bitwise_equal(buffers[1].at(name), values));
    }
  }
}

TEST_CASE("QuantizerSync: a HierarchicalVQ applies no codebook state inside its forward") {
  // On its own a shared codebook's later levels see the earlier levels' EMA
  // step within one forward (the reference); under QuantizerSync every
  // level's statistics wait for sync_state().
  for (const bool shared : {true, false}) {
    CAPTURE(shared);
    HierarchicalVQOptions o = hvq_options(shared);
    o.layer.kmeans_init = false;
    auto group = ProcessGroup::single();
    auto hvq = make_hvq(o);
    QuantizerSync sync(hvq, *group);
    const State before = buffers_of(*hvq);
    hvq->forward(global_images(0));
    hvq->forward(global_images(1));
    for (const auto& [name, values] : buffers_of(*hvq)) {
      CAPTURE(name);
      CHECK(bitwise_equal(values, before.at(name)));
    }
    sync.sync_state();
    CHECK(max_rel_diff(buffers_of(*hvq).at(shared ? "vq._codebook.embed" : "vqs.0._codebook.embed"),
                       before.at(shared ? "vq._codebook.embed" : "vqs.0._codebook.embed")) > 0);
  }
}
