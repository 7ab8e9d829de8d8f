#include "quant/scalar/evo_lfq.h"

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/join.h"
#include "engine/ops/reduce.h"
#include "engine/ops/reductions.h"
#include "engine/ops/view.h"
#include "engine/random/sampling.h"
#include "quant/streams.h"
#include "quant/vq/top_codes.h"

namespace quanta::quant {
namespace {

[[noreturn]] void evo_fail(const std::string& what) {
  throw std::invalid_argument("[EvoLFQ] " + what);
}

// The module's mode, restored on leaving (encode and decode_bits run in eval).
class EvalMode {
 public:
  explicit EvalMode(Module& m) : m_(m), was_(m.is_training()) { m_.train(false); }
  ~EvalMode() { m_.train(was_); }

 private:
  Module& m_;
  bool was_;
};

}  // namespace

EvoLFQ::EvoLFQ(std::shared_ptr<Module> encoder, std::shared_ptr<Module> decoder, EvoLFQOptions opts,
               Generator& gen)
    : Module("EvoLFQ"), opts_(std::move(opts)), gen_(0) {
  if (!encoder || !decoder) evo_fail("needs an encoder and a decoder");
  if (opts_.pop_size <= opts_.elitism_count)
    evo_fail("pop_size (" + std::to_string(opts_.pop_size) +
             ") must be greater than elitism_count (" + std::to_string(opts_.elitism_count) + ")");
  if (opts_.elitism_count < 0) evo_fail("elitism_count must be >= 0");
  if (opts_.tournament_size < 1) evo_fail("tournament_size must be >= 1");
  if (!(opts_.mutation_rate >= 0 && opts_.mutation_rate <= 1))
    evo_fail("mutation_rate must lie in [0, 1], got " + std::to_string(opts_.mutation_rate));
  if (opts_.generations < 0) evo_fail("generations must be >= 0");
  encoder_ = register_module("encoder", std::move(encoder));
  lfq_ = register_module("lfq", std::make_shared<LFQ>(opts_.lfq, gen));
  decoder_ = register_module("decoder", std::move(decoder));
  gen_ = Generator::named(draw_seed(gen), "evo_lfq");
}

QuantizeOutput EvoLFQ::reconstruct(const Tensor& x, const QuantizeOptions& opts) {
  QuantizeOutput out = lfq_->forward(encoder_->forward(x), Tensor(), opts);
  out.quantized = decoder_->forward(out.quantized);
  return out;
}

Tensor EvoLFQ::encode(const Tensor& x, bool signs) {
  NoGradGuard no_grad;
  EvalMode eval(*this);
  // The bits are the signs of the codes before project_out.
  const Tensor codes =
      lfq_->get_codes_from_indices(lfq_->forward(encoder_->forward(x), Tensor()).indices);
  const Tensor one = gt(codes, constant_like(codes, 0.0));
  return signs ? where(one, ones_like(codes), -ones_like(codes)) : to_dtype(one, codes.dtype());
}

Tensor EvoLFQ::decode_bits(const Tensor& bits) {
  NoGradGuard no_grad;
  EvalMode eval(*this);
  const int64_t c = lfq_->num_codebooks(), d = lfq_->codebook_dim();
  if (bits.dim() < 1 || bits.size(-1) != c * d)
    evo_fail("bits must end in num_codebooks * codebook_dim = " + std::to_string(c * d) + ", got " +
             shape_str(bits.shape()));
  Shape split = bits.shape();
  split.back() = c;
  split.push_back(d);
  // Most significant bit first, as LFQ's indices.
  std::vector<int64_t> weights(static_cast<size_t>(d));
  for (int64_t i = 0; i < d; ++i) weights[size_t(i)] = int64_t{1} << (d - 1 - i);
  const Tensor w =
      from_vector<int64_t>(weights, {d}, {.dtype = DType::i64, .device = bits.device()});
  Tensor indices =
      sum(to_dtype(gt(reshape(bits, split), constant_like(bits, 0.0)), DType::i64) * w, {-1});
  if (!lfq_->keep_num_codebooks_dim()) indices = squeeze(indices, -1);
  return decoder_->forward(lfq_->get_output_from_indices(indices));
}

Tensor EvoLFQ::random_population(const Shape& member, bool signs, Device device) {
  Shape shape{opts_.pop_size};
  shape.insert(shape.end(), member.begin(), member.end());
  const Tensor bits =
      to_dtype(randint(0, 2, shape, gen_, {.dtype = DType::i64, .device = device}), DType::f32);
  return signs ? bits * 2.0 - 1.0 : bits;
}

Tensor EvoLFQ::population_from_data(const Tensor& x, bool signs) {
  Tensor bits = encode(x, signs);
  const int64_t n = bits.size(0);
  if (n == 0) evo_fail("population_from_data needs at least one sample");
  if (n < opts_.pop_size) {
    std::vector<Tensor> copies((opts_.pop_size + n - 1) / n, bits);
    bits = cat(copies, 0);
  }
  return mutate(slice(bits, 0, 0, opts_.pop_size), signs);
}

Tensor EvoLFQ::mutate(const Tensor& population, bool signs) {
  if (opts_.mutation_rate <= 0) return population;
  const Tensor flip = lt(rand(population.shape(), gen_, options_of(population)),
                         constant_like(population, opts_.mutation_rate));
  return where(flip, signs ? -population : 1.0 - population, population);
}

EvoLFQ::Generation EvoLFQ::step(const Tensor& population, const Fitness& fitness, bool signs) {
  NoGradGuard no_grad;
  const int64_t p = population.size(0);
  if (p <= opts_.elitism_count)
    evo_fail("a population of " + std::to_string(p) + " cannot keep " +
             std::to_string(opts_.elitism_count) + " elites");
  Tensor fit = fitness(decode_bits(population), population);
  if (fit.numel() != p)
    evo_fail("the fitness must give one value per member (" + std::to_string(p) + "), got " +
             shape_str(fit.shape()));
  fit = reshape(to_dtype(fit, DType::f32), {p});
  const int64_t children = p - opts_.elitism_count;
  const TensorOptions i64{.dtype = DType::i64, .device = population.device()};
  std::vector<Tensor> parts;
  if (opts_.elitism_count > 0)
    parts.push_back(index_select(population, 0, top_indices(fit, opts_.elitism_count)));
  // Two tournaments per child: the fittest of tournament_size random members each.
  const Tensor contenders = randint(0, p, {children, 2, opts_.tournament_size}, gen_, i64);
  const Tensor scores = reshape(index_select(fit, 0, flatten(contenders)), contenders.shape());
  const Tensor parents = squeeze(gather(contenders, -1, argmax(scores, -1, true)), -1);  // [n, 2]
  const Tensor first = index_select(population, 0, select(parents, 1, 0));
  const Tensor second = index_select(population, 0, select(parents, 1, 1));
  const Tensor take_first =
      lt(rand(first.shape(), gen_, options_of(first)), constant_like(first, 0.5));
  parts.push_back(mutate(where(take_first, first, second), signs));
  return {cat(parts, 0), fit};
}

EvoLFQ::Result EvoLFQ::evolve(const Fitness& fitness, Tensor population, int64_t generations,
                              bool signs,
                              const std::function<void(int64_t, const Result&)>& on_generation) {
  Result r;
  const int64_t n = generations > 0 ? generations : opts_.generations;
  for (int64_t g = 0; g < n; ++g) {
    const Generation next = step(population, fitness, signs);
    // The fittest of the population just measured (not of the next one).
    const Tensor best = argmax(next.fitness, 0);
    const double value = index_select(next.fitness, 0, reshape(best, {1})).item();
    if (!r.best_bits.defined() || value > r.best_fitness) {
      r.best_fitness = value;
      r.best_bits = squeeze(index_select(population, 0, reshape(best, {1})), 0);
    }
    population = next.population;
    r.population = population;
    if (on_generation) on_generation(g, r);
  }
  r.population = population;
  return r;
}

}  // namespace quanta::quant
