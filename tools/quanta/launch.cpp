// `quanta launch -n N -- PROGRAM` (filled in by its issue).
#include <stdexcept>

#include "commands.h"

namespace quanta::cli {

void add_launch(CLI::App& app) {
  CLI::App* sub = app.add_subcommand("launch", "start N local ranks (not built yet)");
  sub->allow_extras();
  sub->callback([] { throw std::runtime_error("quanta launch: not built yet"); });
}

}  // namespace quanta::cli
