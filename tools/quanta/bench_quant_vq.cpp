// The vq rows of `quanta bench quant` (filled in by its issue).
#include <stdexcept>

#include "bench.h"

namespace quanta::cli {

std::vector<BenchRow> bench_quant_vq(const BenchOptions&) {
  throw std::runtime_error("bench quant: the vq quantizer rows are not built yet");
}

}  // namespace quanta::cli
