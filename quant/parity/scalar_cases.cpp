// Parity runner for the FSQ and LFQ families (filled in by its issue).
#include "quant/parity/parity.h"

namespace quanta::parity {

void run_scalar_case(const CaseFile&, double, CaseResult& r) {
  throw UnsupportedCase("class '" + r.cls + "': the FSQ and LFQ families is not built yet");
}

}  // namespace quanta::parity
