// `quanta quantize IN OUT` (filled in by its issue).
#include <stdexcept>

#include "commands.h"

namespace quanta::cli {

void add_quantize(CLI::App& app) {
  CLI::App* sub = app.add_subcommand("quantize", "NF4-quantize a checkpoint (not built yet)");
  sub->allow_extras();
  sub->callback([] { throw std::runtime_error("quanta quantize: not built yet"); });
}

}  // namespace quanta::cli
