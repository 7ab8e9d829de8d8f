// Parity runner for the VectorQuantize family (filled in by its issue).
#include "quant/parity/parity.h"

namespace quanta::parity {

void run_vq_case(const CaseFile&, double, CaseResult& r) {
  throw UnsupportedCase("class '" + r.cls + "': the VectorQuantize family is not built yet");
}

}  // namespace quanta::parity
