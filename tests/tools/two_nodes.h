#pragma once
// Two `quanta launch` processes on loopback acting as the two nodes of one
// job (--nnodes 2 --node-rank 0/1 --master-addr 127.0.0.1): how the tests
// run a multi-node job on one machine.
#include <array>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "cli_runner.h"
#include "dist/store/store.h"

namespace quanta::test {

// For CAPTURE(result): what the run printed, shown when a check fails.
inline std::ostream& operator<<(std::ostream& os, const CliResult& r) {
  return os << "exit " << r.code << "\n--- stdout\n" << r.out << "--- stderr\n" << r.err;
}

// `quanta launch` of node `node` of 2, `per_node` ranks each, on loopback.
inline std::vector<std::string> node_args(int node, int port, int per_node, int max_restarts,
                                          const std::vector<std::string>& program) {
  std::vector<std::string> args = {"launch",
                                   "--nnodes",
                                   "2",
                                   "--node-rank",
                                   std::to_string(node),
                                   "--nproc-per-node",
                                   std::to_string(per_node),
                                   "--master-addr",
                                   "127.0.0.1",
                                   "--master-port",
                                   std::to_string(port),
                                   "--max-restarts",
                                   std::to_string(max_restarts),
                                   "--dist-timeout",
                                   "30",
                                   "--"};
  args.insert(args.end(), program.begin(), program.end());
  return args;
}

// What the two launchers of a two-node job printed.
struct TwoNodeJob {
  CliResult r0, r1;
};

inline std::ostream& operator<<(std::ostream& os, const TwoNodeJob& job) {
  return os << "node 0: " << job.r0 << "\nnode 1: " << job.r1;
}

// One job of two launchers on loopback (a fresh port), `per_node[n]` ranks on
// node n, node `first` started first; runs until both launchers exit.
inline TwoNodeJob launch_two_nodes(const std::vector<std::string>& program,
                                   std::array<int, 2> per_node, int max_restarts, int first) {
  const int port = dist::free_port();
  std::array<std::unique_ptr<CliProcess>, 2> nodes;
  for (const int node : {first, 1 - first})
    nodes[size_t(node)] = std::make_unique<CliProcess>(
        node_args(node, port, per_node[size_t(node)], max_restarts, program));
  TwoNodeJob job;
  job.r0 = nodes[0]->wait();
  job.r1 = nodes[1]->wait();
  return job;
}

}  // namespace quanta::test
