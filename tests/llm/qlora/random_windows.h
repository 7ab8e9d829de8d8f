#pragma once
// Training data for the starts that read it (EVA's, CorDA's): windows of
// random ids below the tiny models' vocabulary of 64.
#include <cstdint>

#include "engine/factory.h"
#include "llm/data/lm_examples.h"

namespace quanta::testing {

inline llm::LmExamples random_windows(int64_t windows, int64_t seq_len, uint64_t seed) {
  Generator gen(seed);
  const Tensor ids = randint(0, 64, {windows * seq_len}, gen);
  return llm::LmExamples::from_ids(ids.to_vector<int64_t>(), "random ids", seq_len, 64);
}

}  // namespace quanta::testing
