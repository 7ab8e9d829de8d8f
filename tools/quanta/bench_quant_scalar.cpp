// The scalar rows of `quanta bench quant` (filled in by its issue).
#include <stdexcept>

#include "bench.h"

namespace quanta::cli {

std::vector<BenchRow> bench_quant_scalar(const BenchOptions&) {
  throw std::runtime_error("bench quant: the scalar quantizer rows are not built yet");
}

}  // namespace quanta::cli
