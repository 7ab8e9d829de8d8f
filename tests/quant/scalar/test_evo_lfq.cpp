// EvoLFQ: bits and their decoding against the LFQ's own codes, one generation's
// rules (elites kept, children made of their parents' bits, the population's
// alphabet kept), and a search that finds the fittest bit string of a toy
// problem. Its steps are random from start to end, so there are no reference
// vectors (tests/data/reference-vectors/README.md says why).
#include <doctest/doctest.h>

#include <set>
#include <vector>

#include "engine/nn/layers.h"
#include "quant/scalar/evo_lfq.h"
#include "quanta.h"

using namespace quanta;
using namespace quanta::quant;

namespace {

EvoLFQOptions options(int64_t pop = 16) {
  EvoLFQOptions o;
  o.lfq.dim = 8;
  o.lfq.codebook_size = 256;
  o.pop_size = pop;
  o.mutation_rate = 0.05;
  return o;
}

std::shared_ptr<EvoLFQ> make(Generator& gen, EvoLFQOptions o = options()) {
  return std::make_shared<EvoLFQ>(std::make_shared<Linear>(8, 8, gen), std::make_shared<Identity>(),
                                  o, gen);
}

// Fitness: the number of ones.
Tensor ones_count(const Tensor&, const Tensor& bits) {
  return sum(gt(bits, scalar_like(bits, 0.0)), {-1});
}

}  // namespace

TEST_CASE("EvoLFQ: bits decode to what the autoencoder reconstructs") {
  Generator gen(1), data(2);
  auto evo = make(gen);
  evo->eval();
  const Tensor x = randn({5, 8}, data);
  const Tensor bits = evo->encode(x);
  CHECK(bits.shape() == Shape{5, 8});
  for (double b : bits.to_vector<double>()) CHECK((b == 0.0 || b == 1.0));
  const Tensor recon = evo->reconstruct(x).quantized;
  const auto a = evo->decode_bits(bits).to_vector<float>(), r = recon.to_vector<float>();
  CHECK(a == r);
  // Signs decode the same.
  CHECK(evo->decode_bits(evo->encode(x, true)).to_vector<float>() == r);
  CHECK(evo->is_training() == false);
  evo->train();
  evo->encode(x);
  CHECK(evo->is_training());  // encode restores the mode
  CHECK_THROWS_WITH_AS(evo->decode_bits(zeros({2, 7})), doctest::Contains("must end in"),
                       std::invalid_argument);
}

TEST_CASE("EvoLFQ step: elites carried over, children from their parents' bits") {
  Generator gen(3);
  EvoLFQOptions o = options(12);
  o.elitism_count = 2;
  o.mutation_rate = 0;  // children are pure crossovers
  auto evo = make(gen, o);
  for (bool signs : {false, true}) {
    CAPTURE(signs);
    const Tensor pop = evo->random_population({8}, signs);
    const EvoLFQ::Generation g = evo->step(pop, ones_count, signs);
    REQUIRE(g.population.shape() == pop.shape());
    REQUIRE(g.fitness.shape() == Shape{12});
    const auto fit = g.fitness.to_vector<double>();
    const auto before = pop.to_vector<float>(), after = g.population.to_vector<float>();
    // The two fittest first, in order.
    std::vector<int> order(12);
    for (int i = 0; i < 12; ++i) order[size_t(i)] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return fit[size_t(a)] > fit[size_t(b)]; });
    for (int e = 0; e < 2; ++e)
      for (int k = 0; k < 8; ++k)
        CHECK(after[size_t(e * 8 + k)] == before[size_t(order[size_t(e)] * 8 + k)]);
    // Every bit of a child is some member's bit at that position; the alphabet is kept.
    for (int c = 2; c < 12; ++c)
      for (int k = 0; k < 8; ++k) {
        const float v = after[size_t(c * 8 + k)];
        CHECK((signs ? (v == -1.0f || v == 1.0f) : (v == 0.0f || v == 1.0f)));
        bool seen = false;
        for (int m = 0; m < 12; ++m) seen = seen || before[size_t(m * 8 + k)] == v;
        CHECK(seen);
      }
  }
}

TEST_CASE("EvoLFQ evolve: the best never gets worse and the toy optimum is found") {
  Generator gen(4);
  auto evo = make(gen, options(24));
  std::vector<double> best;
  const EvoLFQ::Result r =
      evo->evolve(ones_count, evo->random_population({8}), 40, false,
                  [&](int64_t, const EvoLFQ::Result& now) { best.push_back(now.best_fitness); });
  REQUIRE(best.size() == 40);
  for (size_t i = 1; i < best.size(); ++i) CHECK(best[i] >= best[i - 1]);
  CHECK(r.best_fitness == 8.0);
  CHECK(sum(r.best_bits).item() == 8.0);  // the gene the fitness was measured on
  // The same seed runs the same search.
  Generator again(4);
  auto twin = make(again, options(24));
  const EvoLFQ::Result s = twin->evolve(ones_count, twin->random_population({8}), 40);
  CHECK(s.population.to_vector<float>() == r.population.to_vector<float>());
  // A population seeded from data keeps its size.
  Generator data(5);
  CHECK(evo->population_from_data(randn({5, 8}, data)).shape() == Shape{24, 8});
}

TEST_CASE("EvoLFQ: refusals name the option") {
  Generator gen(6);
  EvoLFQOptions o = options(4);
  o.elitism_count = 4;
  CHECK_THROWS_WITH_AS(make(gen, o), doctest::Contains("must be greater than elitism_count"),
                       std::invalid_argument);
  o = options();
  o.mutation_rate = 2;
  CHECK_THROWS_WITH_AS(make(gen, o), doctest::Contains("mutation_rate must lie in [0, 1]"),
                       std::invalid_argument);
  o = options();
  o.tournament_size = 0;
  CHECK_THROWS_WITH_AS(make(gen, o), doctest::Contains("tournament_size must be >= 1"),
                       std::invalid_argument);
  auto evo = make(gen);
  CHECK_THROWS_WITH_AS(evo->step(evo->random_population({8}),
                                 [](const Tensor&, const Tensor&) { return zeros({3}); }),
                       doctest::Contains("one value per member (16)"), std::invalid_argument);
}
