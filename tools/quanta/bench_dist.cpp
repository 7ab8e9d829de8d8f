// `quanta bench dist` (filled in by its issue).
#include <stdexcept>

#include "bench.h"

namespace quanta::cli {

std::vector<BenchRow> bench_dist(const BenchOptions&) {
  throw std::runtime_error("bench dist: not built yet");
}

}  // namespace quanta::cli
