#pragma once
// One attempt of `quanta launch` on this node: starts the node's ranks (each
// in its own process group, killed by the kernel if the launcher dies),
// relays their output line by line with a "[rank R] " prefix, and stops them
// all (SIGTERM, then SIGKILL after a grace period) when the first one fails,
// when the launcher gets SIGINT / SIGTERM, or when another node says so.
// The restart loop around attempts is launch.cpp's; talking to other nodes
// is node_group.h's.
#include <functional>
#include <string>
#include <vector>

namespace quanta::cli::launch {

/** One rank to start: its global rank and the variables it gets on top of
 * the launcher's environment (KEY=VALUE; inherited values of those keys are
 * dropped first). */
struct RankStart {
  int rank = 0;
  std::vector<std::string> env;
};

/** What the other nodes say while this node's ranks run. */
struct PeerNews {
  enum class State { running, failed, stopping } state = State::running;
  /** What happened, for this launcher's line ("rank 3 on node 1 exited with status 7"). */
  std::string what{};
};

/** How an attempt is run. */
struct AttemptOptions {
  /** The program and its arguments. */
  std::vector<std::string> program;
  /** Prefix of the launcher's own lines: "[launch]" or "[launch node 1]". */
  std::string tag = "[launch]";
  /** Polled about every 100 ms while ranks run (several nodes); none: one node. */
  std::function<PeerNews()> poll_peers{};
  /** Called once when a rank of this node fails first: its rank, the
   * description ("rank 1 exited with status 7") and its status. */
  std::function<void(int, const std::string&, int)> on_failure{};
  /** Called once when a stop signal reaches this launcher. */
  std::function<void(int)> on_stop{};
};

/** How an attempt ended on this node. */
struct AttemptResult {
  /** The rank that failed first (-1: none failed before a stop). */
  int failed_rank = -1;
  /** "rank 1 exited with status 7" / "rank 1 was killed by signal 9 (Killed)". */
  std::string failure{};
  /** The failed rank's status, else the first non-zero status of a rank (in
   * rank order), else 0. A status is the exit code, or 128 + the signal. */
  int status = 0;
  /** The SIGINT / SIGTERM that stopped the ranks (0: none). */
  int stop_signal = 0;
  /** The ranks were stopped because another node failed or was stopped. */
  bool stopped_by_peer = false;
};

/** Makes SIGINT and SIGTERM ask the launcher to stop (see stop_signal()). */
void catch_stop_signals();

/** The stop signal received so far (0: none). */
int stop_signal();

/** Starts `ranks` and waits until all have exited and their output is
 * relayed. Throws std::runtime_error when a rank cannot be started (the
 * ones already started are killed). */
AttemptResult run_attempt(const std::vector<RankStart>& ranks, const AttemptOptions& opts);

}  // namespace quanta::cli::launch
