// `quanta bench nf4` (filled in by its issue).
#include <stdexcept>

#include "bench.h"

namespace quanta::cli {

std::vector<BenchRow> bench_nf4(const BenchOptions&) {
  throw std::runtime_error("bench nf4: not built yet");
}

}  // namespace quanta::cli
