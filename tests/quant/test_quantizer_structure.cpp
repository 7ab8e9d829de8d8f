// The quantizer structure: every residual and grouped family
// behind one Quantizer interface, one quantize-dropout rule, a dropout
// decision taken from outside. Also the behaviour the unification changed
// (each case says what it was before). And a toy family that gets its
// residual and grouped forms from its LayerTraits alone.
#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "quant/grouped_of.h"
#include "quant/quantizer.h"
#include "quant/residual_of_impl.h"
#include "quant/scalar/residual_fsq.h"
#include "quant/scalar/residual_lfq.h"
#include "quant/vq/residual_vq.h"
#include "quant/vq/sim_vq.h"
#include "quanta.h"

using namespace quanta;
using namespace quanta::quant;

namespace {

constexpr int64_t kDim = 8, kLayers = 4;

ResidualVQOptions rvq_options(bool drop) {
  ResidualVQOptions o;
  o.dim = kDim;
  o.num_quantizers = kLayers;
  o.codebook_sizes = {16};
  o.quantize_dropout = drop;
  return o;
}

ResidualFSQOptions rfsq_options(bool drop) {
  ResidualFSQOptions o;
  o.fsq.levels = {5, 4, 3};
  o.fsq.dim = kDim;
  o.num_quantizers = kLayers;
  o.quantize_dropout = drop;
  return o;
}

ResidualLFQOptions rlfq_options(bool drop) {
  ResidualLFQOptions o;
  o.lfq.dim = kDim;
  o.lfq.codebook_size = 16;
  o.num_quantizers = kLayers;
  o.quantize_dropout = drop;
  return o;
}

// Every residual and grouped family, as the interface.
std::vector<std::pair<std::string, std::shared_ptr<Quantizer>>> all_quantizers(bool drop) {
  Generator gen(3);
  std::vector<std::pair<std::string, std::shared_ptr<Quantizer>>> out;
  out.emplace_back("ResidualVQ", std::make_shared<ResidualVQ>(rvq_options(drop), gen));
  GroupedResidualVQOptions g;
  g.dim = kDim;
  g.groups = 2;
  g.rvq = rvq_options(drop);
  out.emplace_back("GroupedResidualVQ", std::make_shared<GroupedResidualVQ>(g, gen));
  ResidualSimVQOptions s;
  s.dim = kDim;
  s.num_quantizers = kLayers;
  s.codebook_size = 16;
  s.quantize_dropout = drop;
  out.emplace_back("ResidualSimVQ", std::make_shared<ResidualSimVQ>(s, gen));
  out.emplace_back("ResidualFSQ", std::make_shared<ResidualFSQ>(rfsq_options(drop), gen));
  GroupedResidualFSQOptions gf;
  gf.rfsq = rfsq_options(drop);
  gf.groups = 2;
  out.emplace_back("GroupedResidualFSQ", std::make_shared<GroupedResidualFSQ>(gf, gen));
  out.emplace_back("ResidualLFQ", std::make_shared<ResidualLFQ>(rlfq_options(drop), gen));
  GroupedResidualLFQOptions gl;
  gl.rlfq = rlfq_options(drop);
  gl.rlfq.lfq.codebook_size = 4;
  gl.groups = 2;
  out.emplace_back("GroupedResidualLFQ", std::make_shared<GroupedResidualLFQ>(gl, gen));
  return out;
}

// The last kept layer of indices [..., Q] (the same for every token).
int64_t last_kept_of(const Tensor& indices) {
  const std::vector<int64_t> v = indices.to(DType::i64).to_vector<int64_t>();
  int64_t last = kLayers - 1;
  while (last > 0 && v[static_cast<size_t>(last)] == -1) --last;
  return last;
}

}  // namespace

namespace {

// A toy family: one feature per layer, the codes -1, 0 and 1 (index code + 1),
// the straight-through gradient and loss mse(x, sg(q)). It states its
// LayerTraits and nothing else; ResidualOf and GroupedOf do the rest.
struct ToyOptions {
  int64_t dim = 1, num_quantizers = 1;
  QuantizeDropout dropout{};
};
struct ToyGroupedOptions {
  ToyOptions stack;
  int64_t groups = 1;
};

class ToyLayer : public SingleLayerQuantizer {
 public:
  explicit ToyLayer(Generator&) : SingleLayerQuantizer("ToyLayer") {}
  QuantizeOutput forward(const Tensor& x, const Tensor&, const QuantizeOptions&) override {
    const Tensor q = round(clamp(x.detach(), -1.0, 1.0));
    QuantizeOutput out;
    out.quantized = x + (q - x).detach();
    out.indices = squeeze(q + 1.0, -1).to(DType::i64);
    const Tensor err = x - q;
    out.loss = mean(err * err);
    return out;
  }
  Tensor get_codes_from_indices(const Tensor& i) override {
    return unsqueeze(i.to(DType::f32) - 1.0, -1);
  }
  Tensor get_output_from_indices(const Tensor& i) override { return get_codes_from_indices(i); }
  int64_t codebook_size() const override { return 3; }
  int64_t num_codebooks() const override { return 1; }
};

}  // namespace

template <>
struct quanta::quant::LayerTraits<ToyLayer> {
  using Options = ToyOptions;
  using GroupedOptions = ToyGroupedOptions;
  static constexpr const char* name = "ResidualToy";
  static constexpr const char* grouped_name = "GroupedResidualToy";
  static constexpr DType index_dtype = DType::i64;
  static constexpr MemberLosses losses = MemberLosses::stacked;
  static StackPlan plan(Options& o) {
    return {.dim = o.dim, .layer_dim = 1, .num_quantizers = o.num_quantizers, .dropout = o.dropout};
  }
  static std::shared_ptr<ToyLayer> make_layer(const Options&, const StackPlan&, int64_t,
                                              const std::vector<std::shared_ptr<ToyLayer>>&,
                                              Generator& gen) {
    return std::make_shared<ToyLayer>(gen);
  }
  static QuantizeOutput quantize(ToyLayer& l, const Tensor& r, const Tensor& mask,
                                 const QuantizeOptions& o) {
    return l.forward(r, mask, o);
  }
  static Tensor codes(ToyLayer& l, const Tensor& i) { return l.get_codes_from_indices(i); }
  static GroupedLayout grouped_layout(const GroupedOptions& o) {
    return {.dim = o.stack.dim, .groups = o.groups};
  }
  static Options group_options(const GroupedOptions& o) {
    Options s = o.stack;
    s.dim = o.stack.dim / o.groups;
    return s;
  }
};

namespace {

std::vector<double> vals(const Tensor& t) { return t.to(DType::f64).to_vector<double>(); }

}  // namespace

TEST_CASE("a toy family gets its residual and grouped forms from its traits alone") {
  Generator gen(9);
  ResidualOf<ToyLayer> stack(ToyOptions{.dim = 1, .num_quantizers = 3}, gen);
  CHECK(stack.num_quantizers() == 3);
  CHECK(stack.num_codebooks() == 3);
  CHECK(stack.codebook_size() == 3);
  CHECK_FALSE(stack.has_projections());
  CHECK(stack.named_parameters().empty());
  // 2.4: layer 0 takes 1 (clamped), layer 1 the residual 1.4 as 1, layer 2
  // 0.4 as 0; the output is their sum, and each layer passes its gradient
  // straight through to x (a residual is cut from the codes, not from x).
  const Tensor x = from_vector<double>({2.4, -0.6}, {1, 2, 1}).to(DType::f32).requires_grad_();
  QuantizeOutput o = stack.forward(x, Tensor());
  CHECK(vals(o.quantized) == std::vector<double>{2, -1});
  CHECK(vals(o.indices) == std::vector<double>{2, 2, 1, 0, 1, 1});
  CHECK(o.loss.shape() == Shape{3});
  sum(o.quantized).backward();
  CHECK(vals(x.grad()) == std::vector<double>{3, 3});
  CHECK(vals(stack.get_output_from_indices(o.indices)) == std::vector<double>{2, -1});
  // A dropout decision from outside: later layers give -1 and look up zeros.
  o = stack.forward(x, Tensor(), QuantizeOptions{.last_kept = 0});
  CHECK(vals(o.indices) == std::vector<double>{2, -1, -1, 0, -1, -1});
  CHECK(vals(o.quantized) == std::vector<double>{1, -1});
  // Wider inputs get projections, built from the generator: the same seed,
  // the same stack.
  Generator a(4), b(4);
  ResidualOf<ToyLayer> pa(ToyOptions{.dim = 3, .num_quantizers = 2}, a);
  ResidualOf<ToyLayer> pb(ToyOptions{.dim = 3, .num_quantizers = 2}, b);
  CHECK(pa.has_projections());
  CHECK(vals(pa.state_dict().at(0).second) == vals(pb.state_dict().at(0).second));
  // The grouped form: one stack per feature, one decision for all of them.
  GroupedOf<ToyLayer> grouped(
      ToyGroupedOptions{.stack = {.dim = 2, .num_quantizers = 3}, .groups = 2}, gen);
  CHECK(grouped.type_name() == "GroupedResidualToy");
  CHECK(grouped.num_codebooks() == 6);
  const Tensor pair = from_vector<double>({2.4, -0.6}, {1, 1, 2}).to(DType::f32);
  o = grouped.forward(pair, Tensor(), QuantizeOptions{.last_kept = 1});
  CHECK(vals(o.quantized) == std::vector<double>{2, -1});
  CHECK(vals(o.indices) == std::vector<double>{2, 2, -1, 0, 1, -1});
  CHECK(o.loss.shape() == Shape{2, 3});
  CHECK(vals(grouped.get_output_from_indices(o.indices)) == std::vector<double>{2, -1});
  CHECK_THROWS_AS(GroupedOf<ToyLayer>(ToyGroupedOptions{.stack = {.dim = 3}, .groups = 2}, gen),
                  std::invalid_argument);
  CHECK_THROWS_AS(ResidualOf<ToyLayer>(ToyOptions{.num_quantizers = 0}, gen),
                  std::invalid_argument);
}

TEST_CASE("QuantizeDropout: uniform in [cutoff, Q - 1], rounded up to multiple_of, capped") {
  Generator gen(1);
  const QuantizeDropout plain{true, 1, 1};
  std::set<int64_t> seen;
  for (int i = 0; i < 200; ++i) seen.insert(plain.draw(gen, 6));
  CHECK(seen == std::set<int64_t>{1, 2, 3, 4, 5});
  // k + 1 rounded up to a multiple of 4: 3, or 7 capped at the last layer 5.
  const QuantizeDropout structured{true, 0, 4};
  seen.clear();
  for (int i = 0; i < 200; ++i) seen.insert(structured.draw(gen, 6));
  CHECK(seen == std::set<int64_t>{3, 5});
  CHECK(plain.applies(true, 6));
  CHECK_FALSE(plain.applies(false, 6));
  CHECK_FALSE(plain.applies(true, 1));
  CHECK_FALSE(QuantizeDropout{}.applies(true, 6));
  CHECK_THROWS_AS(QuantizeDropout({true, 6, 1}).check("t", 6), std::invalid_argument);
  CHECK_THROWS_AS(QuantizeDropout({false, 0, 0}).check("t", 6), std::invalid_argument);
  CHECK_NOTHROW(QuantizeDropout({false, 9, 1}).check("t", 6));  // unused when off
}

TEST_CASE("every residual and grouped family takes a dropout decision from outside") {
  Generator gen(2);
  for (auto& [name, q] : all_quantizers(false)) {
    INFO(name);
    CHECK(q->num_quantizers() == kLayers);
    for (bool training : {true, false}) {
      q->train(training);
      const Tensor x = randn({2, 5, kDim}, gen);
      const QuantizeOutput o = q->forward(x, Tensor(), QuantizeOptions{.last_kept = 1});
      const bool grouped = name.rfind("Grouped", 0) == 0;
      CHECK(o.indices.dim() == (grouped ? 4 : 3));
      CHECK(last_kept_of(grouped ? select(o.indices, 0, 1) : o.indices) == 1);
      if (!training) {  // (training forwards may move the codebooks afterwards)
        // Dropped layers look up zeros: the output is the kept layers' codes.
        NoGradGuard ng;
        const Tensor back = q->get_output_from_indices(o.indices);
        CHECK(max(abs(back - o.quantized.detach())).item() < 1e-5);
      }
      // No dropout configured: the layer's own decision keeps every layer.
      CHECK(q->dropout_decision() == kKeepAllLayers);
    }
  }
}

TEST_CASE("every family reports its codebook size and its index columns") {
  // What `quanta train` reads of a layer besides forward and decode.
  for (auto& [name, q] : all_quantizers(false)) {
    INFO(name);
    const bool grouped = name.rfind("Grouped", 0) == 0;
    CHECK(q->num_codebooks() == (grouped ? 2 : 1) * kLayers);
    const int64_t size = name.find("FSQ") != std::string::npos ? 60
                         : name == "GroupedResidualLFQ"        ? 4
                                                               : 16;
    CHECK(q->codebook_size() == size);
  }
  // A stack of differently sized layers reports the largest.
  Generator gen(12);
  ResidualVQOptions o = rvq_options(false);
  o.codebook_sizes = {8, 32, 16, 4};
  CHECK(ResidualVQ(o, gen).codebook_size() == 32);
  VectorQuantizeOptions heads;
  heads.dim = kDim;
  heads.codebook_size = 16;
  heads.heads = 2;
  heads.codebook_dim = kDim / 2;
  CHECK(VectorQuantize(heads, gen).num_codebooks() == 2);
}

TEST_CASE("quantize dropout applies to training forwards with grad off too") {
  // Before the unification the scalar family (ResidualFSQ, ResidualLFQ and their
  // grouped forms) dropped layers only with grad enabled, the VQ family in
  // every training forward; now all follow vector-quantize-pytorch's
  // ResidualVQ: training decides, grad mode does not.
  Generator gen(4);
  for (auto& [name, q] : all_quantizers(true)) {
    INFO(name);
    q->train();
    const bool grouped = name.rfind("Grouped", 0) == 0;
    std::set<int64_t> kept;
    NoGradGuard ng;
    for (int i = 0; i < 30; ++i) {
      const QuantizeOutput o = q->forward(randn({1, 3, kDim}, gen), Tensor(), QuantizeOptions{});
      kept.insert(last_kept_of(grouped ? select(o.indices, 0, 0) : o.indices));
    }
    CHECK(kept.size() > 1);
    q->eval();
    CHECK(q->dropout_decision() == kKeepAllLayers);
  }
}

TEST_CASE("a cutoff_index outside the stack fails at construction in every family") {
  // Before: ResidualFSQ and ResidualLFQ clamped it silently, ResidualSimVQ
  // failed in its first training forward (randint), ResidualVQ at construction.
  Generator gen(5);
  ResidualFSQOptions f = rfsq_options(true);
  f.quantize_dropout_cutoff_index = kLayers;
  CHECK_THROWS_AS(ResidualFSQ(f, gen), std::invalid_argument);
  ResidualLFQOptions l = rlfq_options(true);
  l.quantize_dropout_cutoff_index = kLayers;
  CHECK_THROWS_AS(ResidualLFQ(l, gen), std::invalid_argument);
  ResidualSimVQOptions s;
  s.dim = kDim;
  s.num_quantizers = kLayers;
  s.codebook_size = 16;
  s.quantize_dropout = true;
  s.quantize_dropout_cutoff_index = kLayers;
  CHECK_THROWS_AS(ResidualSimVQ(s, gen), std::invalid_argument);
  ResidualVQOptions v = rvq_options(true);
  v.quantize_dropout_multiple_of = 0;
  CHECK_THROWS_AS(ResidualVQ(v, gen), std::invalid_argument);
}

TEST_CASE("ResidualFSQ and ResidualLFQ look up fewer layers than they have") {
  // Before: indices had to end in exactly num_quantizers; now, as ResidualVQ,
  // missing layers count as dropped (vector-quantize-pytorch pads with -1).
  Generator gen(6);
  ResidualFSQ f(rfsq_options(false), gen);
  ResidualLFQ l(rlfq_options(false), gen);
  f.eval();
  l.eval();
  for (Quantizer* q : {static_cast<Quantizer*>(&f), static_cast<Quantizer*>(&l)}) {
    const QuantizeOutput o = q->forward(randn({2, 5, kDim}, gen), Tensor(), QuantizeOptions{});
    const Tensor two = slice(o.indices, -1, 0, 2);
    const Tensor codes = q->get_codes_from_indices(two);
    CHECK(codes.size(0) == kLayers);
    CHECK(max(abs(slice(codes, 0, 2, kLayers))).item() == 0.0);
    const Tensor padded = cat({two, full({2, 5, 2}, -1.0, {.dtype = two.dtype()})}, -1);
    CHECK(max(abs(q->get_codes_from_indices(padded) - codes)).item() == 0.0);
  }
}

TEST_CASE("loss terms: ResidualSimVQ stacks its commitment, GroupedResidualVQ its terms") {
  // Before: ResidualSimVQ and GroupedResidualVQ returned no loss terms.
  Generator gen(7);
  for (auto& [name, q] : all_quantizers(false)) {
    if (name != "ResidualSimVQ" && name != "GroupedResidualVQ") continue;
    INFO(name);
    q->train();
    const QuantizeOutput o = q->forward(randn({2, 5, kDim}, gen), Tensor(), QuantizeOptions{});
    const Tensor c = o.term("commitment");
    CHECK(c.shape() == o.loss.shape());
    if (name == "ResidualSimVQ") CHECK(max(abs(c - o.loss)).item() == 0.0);
  }
}

TEST_CASE("ResidualVQ and GroupedResidualVQ check their masks") {
  // Before: a mask was reshaped without a check (a wrong size failed inside
  // reshape, a float mask inside the layer).
  Generator gen(8);
  for (auto& [name, q] : all_quantizers(false)) {
    INFO(name);
    const Tensor x = randn({2, 5, kDim}, gen);
    CHECK_THROWS_AS(q->forward(x, ones({2, 4}, {.dtype = DType::boolean}), QuantizeOptions{}),
                    std::invalid_argument);
    CHECK_THROWS_AS(q->forward(x, ones({2, 5}), QuantizeOptions{}), std::invalid_argument);
  }
}
