#include "graph_flag.h"

namespace quanta::cli {

CLI::Option* add_no_graph_flag(CLI::App& sub, bool& no_graph, const std::string& prefix) {
  return sub.add_flag("--no-graph", no_graph,
                      prefix +
                          "on cuda and sim, launch every kernel of every step as it is called "
                          "instead of replaying the step (forward, backward, clipping, optimizer) "
                          "as one captured graph (the same results either way; for profiling "
                          "and for bisecting a difference)");
}

}  // namespace quanta::cli
