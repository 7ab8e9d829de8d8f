#pragma once
// EvoLFQ (vector-quantize-pytorch 1.32's evo_lookup_free_quantization.py): an
// autoencoder around an LFQ whose binary codes can also be searched without
// gradients. A genetic algorithm evolves a population of bit strings against
// any fitness of what the decoder makes of them: tournament selection of two
// parents per child, uniform crossover, bit-flip mutation, the best members
// kept as they are (elitism).
#include <cstdint>
#include <functional>
#include <memory>

#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/quantize_output.h"
#include "quant/scalar/lfq.h"

namespace quanta::quant {

struct EvoLFQOptions {
  /** The quantizer between encoder and decoder. */
  LFQOptions lfq;
  /** Members of a population. */
  int64_t pop_size = 64;
  /** Probability that a child's bit flips. */
  double mutation_rate = 0.02;
  /** Members drawn (with replacement) per parent; the fittest wins. */
  int64_t tournament_size = 2;
  /** The fittest members carried into the next population unchanged (< pop_size). */
  int64_t elitism_count = 1;
  /** Generations evolve() runs when not told otherwise. */
  int64_t generations = 50;
};

/** Fitness of every member: decoded [P, ...] (the decoder's output) and the
 * bits [P, ...] -> [P], higher is better. */
using Fitness = std::function<Tensor(const Tensor& decoded, const Tensor& bits)>;

class EvoLFQ : public Module {
 public:
  /** `encoder` maps inputs to latents [B, dim] or [B, N, dim] (LFQ's layouts),
   * `decoder` maps quantized latents back. Modules "encoder", "lfq",
   * "decoder"; the LFQ and the search's stream ("evo_lfq") come from `gen`. */
  EvoLFQ(std::shared_ptr<Module> encoder, std::shared_ptr<Module> decoder, EvoLFQOptions opts,
         Generator& gen);

  /** decoder(LFQ(encoder(x))): quantized is the reconstruction, indices and
   * losses the LFQ's (the reference's forward). */
  QuantizeOutput reconstruct(const Tensor& x, const QuantizeOptions& opts = {});
  /** reconstruct(x).quantized. */
  Tensor forward(const Tensor& x) override { return reconstruct(x).quantized; }
  /** The LFQ's bits of x in eval, no gradient: [..., num_codebooks *
   * codebook_dim], 0/1 (or -1/+1 with `signs`). */
  Tensor encode(const Tensor& x, bool signs = false);
  /** What the decoder makes of bits [..., num_codebooks * codebook_dim]
   * (> 0 is a one), no gradient. */
  Tensor decode_bits(const Tensor& bits);

  /** pop_size random members of shape `member` (0/1, or -1/+1 with `signs`), f32 on `device`. */
  Tensor random_population(const Shape& member, bool signs = false, Device device = Device::cpu());
  /** The bits of x's first pop_size rows (repeated when there are fewer), mutated. */
  Tensor population_from_data(const Tensor& x, bool signs = false);

  struct Generation {
    /** The next population [P, ...]. */
    Tensor population;
    /** The fitness of the population that was given, [P]. */
    Tensor fitness;
  };
  /** One generation: the fitness of `population`, then elites, tournament
   * parents, crossover and mutation make the next. */
  Generation step(const Tensor& population, const Fitness& fitness, bool signs = false);

  struct Result {
    Tensor population;  // the last generation's next population
    Tensor best_bits;   // the fittest member ever evaluated
    double best_fitness = -1e300;
  };
  /** Runs `generations` (0: the option) steps from `population`, keeping
   * the fittest member ever evaluated; `on_generation`, when given, sees the
   * result after every step (the reference's generator). */
  Result evolve(const Fitness& fitness, Tensor population, int64_t generations = 0,
                bool signs = false,
                const std::function<void(int64_t, const Result&)>& on_generation = {});

  LFQ& lfq() { return *lfq_; }
  const EvoLFQOptions& options() const { return opts_; }

 private:
  Tensor mutate(const Tensor& population, bool signs);

  EvoLFQOptions opts_;
  std::shared_ptr<Module> encoder_, decoder_;
  std::shared_ptr<LFQ> lfq_;
  Generator gen_;
};

}  // namespace quanta::quant
