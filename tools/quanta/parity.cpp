// `quanta parity FILE...` (filled in by its issue).
#include <stdexcept>

#include "commands.h"

namespace quanta::cli {

void add_parity(CLI::App& app) {
  CLI::App* sub = app.add_subcommand("parity", "run reference cases and compare (not built yet)");
  sub->allow_extras();
  sub->callback([] { throw std::runtime_error("quanta parity: not built yet"); });
}

}  // namespace quanta::cli
