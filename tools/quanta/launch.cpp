// `quanta launch [-n K] [--max-restarts N] [--nnodes M --node-rank R
// --master-addr A --master-port P] -- PROGRAM ARGS...`, torchrun's launcher
// with torchrun's flag names: starts K ranks on this node with torchrun's
// environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
// MASTER_ADDR, MASTER_PORT, ...; OMP_NUM_THREADS=1 unless set), the job's
// QUANTA_JOB_TOKEN, and the restart count (QUANTA_RESTART_COUNT, also as
// torchrun's TORCHELASTIC_RESTART_COUNT). When a rank fails the others are
// stopped; with --max-restarts N every rank is started again, up to N times,
// on a fresh rendezvous port. Exits 0 when the last attempt succeeded, else
// with the failing rank's status (128 + signal for a rank killed by one).
// SIGINT / SIGTERM are passed on to the ranks as SIGTERM and end the job (no
// restart); it then exits 0 when every rank exits 0. Ranks die with it.
//
// local_ranks.h runs one attempt on this node; node_group.h makes the
// launchers of several nodes agree on each attempt.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "commands.h"
#include "dist_timeout.h"
#include "flag_checks.h"
#include "launch/local_ranks.h"
#include "launch/node_group.h"
#include "train/limits.h"

namespace quanta::cli {
namespace {

struct LaunchCommand {
  int nproc = 1;  // ranks on this node
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port (one node); torchrun's 29500 (several)
  int max_restarts = 0;
  std::string dist_timeout;  // seconds; empty: the library's default
  std::vector<std::string> program;
};

// Most restarts --max-restarts takes (torchrun sets no limit; this one keeps
// the count an int and is far beyond any real job).
constexpr int64_t kMaxRestarts = 1000000;

// `words` random 32-bit words as hex.
std::string random_hex(int words) {
  std::random_device rd;
  std::string s;
  for (int i = 0; i < words; ++i) {
    char word[9];
    std::snprintf(word, sizeof word, "%08x", static_cast<unsigned>(rd()));
    s += word;
  }
  return s;
}

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

// The job's shared secret for the rank-0 store (QUANTA_JOB_TOKEN): 128
// random bits, so a process outside this job cannot join it or write to its
// store. One already in the environment is kept (several launchers, one job).
std::string job_token() { return env_or("QUANTA_JOB_TOKEN", random_hex(4)); }

// QUANTA_DIST_TIMEOUT (set by --dist-timeout) for the launchers' own waits;
// dist's default otherwise. A malformed value is the ranks' to report.
dist::Millis launcher_timeout() {
  const char* v = std::getenv(kDistTimeoutEnv);
  const double s = v ? std::strtod(v, nullptr) : 0;
  return dist::Millis(s >= 0.001 ? static_cast<int64_t>(s * 1000) : 300000);
}

std::string kv(const char* key, const std::string& value) {
  std::string s = key;
  s += '=';
  s += value;
  return s;
}

// This node's ranks of attempt `attempt`, with torchrun's variables.
std::vector<launch::RankStart> rank_starts(const LaunchCommand& c, int port, int attempt,
                                           const std::string& token, const std::string& run_id) {
  const std::string world = std::to_string(c.nnodes * c.nproc);
  const std::string restart = std::to_string(attempt), most = std::to_string(c.max_restarts);
  std::vector<launch::RankStart> starts;
  for (int local = 0; local < c.nproc; ++local) {
    launch::RankStart s;
    s.rank = c.node_rank * c.nproc + local;
    const std::string rank = std::to_string(s.rank);
    s.env = {kv("RANK", rank),
             kv("LOCAL_RANK", std::to_string(local)),
             kv("GROUP_RANK", std::to_string(c.node_rank)),
             kv("ROLE_RANK", rank),
             kv("WORLD_SIZE", world),
             kv("LOCAL_WORLD_SIZE", std::to_string(c.nproc)),
             kv("GROUP_WORLD_SIZE", std::to_string(c.nnodes)),
             kv("ROLE_WORLD_SIZE", world),
             kv("MASTER_ADDR", c.master_addr),
             kv("MASTER_PORT", std::to_string(port)),
             kv("QUANTA_RESTART_COUNT", restart),
             kv("QUANTA_MAX_RESTARTS", most),
             kv("QUANTA_RUN_ID", run_id),
             kv("TORCHELASTIC_RESTART_COUNT", restart),
             kv("TORCHELASTIC_MAX_RESTARTS", most),
             kv("TORCHELASTIC_RUN_ID", run_id)};
    if (!token.empty()) s.env.push_back(kv("QUANTA_JOB_TOKEN", token));
    // K ranks each with a full OpenMP pool oversubscribe the cores (torchrun too).
    if (!std::getenv("OMP_NUM_THREADS") && c.nproc > 1) s.env.push_back("OMP_NUM_THREADS=1");
    starts.push_back(std::move(s));
  }
  return starts;
}

void check_command(const LaunchCommand& c) {
  if (c.program.empty()) throw UsageError("quanta launch: give the program after --");
  if (c.node_rank >= c.nnodes) {
    std::string e = "--node-rank ";
    e += std::to_string(c.node_rank);
    e += " is not a node of --nnodes ";
    e += std::to_string(c.nnodes);
    e += ": node ranks are 0 to ";
    e += std::to_string(c.nnodes - 1);
    throw UsageError(e);
  }
  if (int64_t(c.nnodes) * c.nproc > train::kMaxRanks) {
    std::string e = "--nnodes ";
    e += std::to_string(c.nnodes);
    e += " x --nproc-per-node ";
    e += std::to_string(c.nproc);
    e += " is ";
    e += std::to_string(int64_t(c.nnodes) * c.nproc);
    e += " ranks: at most ";
    e += std::to_string(train::kMaxRanks);
    throw UsageError(e);
  }
  if (c.master_addr.empty()) throw UsageError("--master-addr: must not be empty");
}

// One line per restart, and one when none is left.
void say_restart(const std::string& tag, const launch::Outcome& o, int attempt, int max_restarts) {
  const std::string what = o.failure.empty() ? "a rank failed" : o.failure;
  std::fprintf(stderr, "%s restart %d of %d: %s in attempt %d; starting every rank again\n",
               tag.c_str(), attempt + 1, max_restarts, what.c_str(), attempt + 1);
}

// Joins the launchers of the other nodes (node 0 hosts their store).
std::unique_ptr<launch::NodeGroup> join_nodes(const LaunchCommand& c, const std::string& token,
                                              const std::string& run_id) {
  if (token.empty())
    std::fprintf(stderr,
                 "[launch node %d] QUANTA_JOB_TOKEN is not set: the job's stores use quanta's "
                 "fixed default token, which keeps out stray processes but not attackers; "
                 "export the same secret on every node (docs/dist.md)\n",
                 c.node_rank);
  launch::NodeGroupOptions o;
  o.nnodes = c.nnodes;
  o.node_rank = c.node_rank;
  o.nproc_per_node = c.nproc;
  o.max_restarts = c.max_restarts;
  o.master_addr = c.master_addr;
  o.master_port = c.master_port ? c.master_port : 29500;
  o.token = token;
  const std::string bind_all = env_or("QUANTA_STORE_BIND_ALL", "0");
  o.bind_all = bind_all == "1" || bind_all == "true" || bind_all == "yes";
  o.timeout = launcher_timeout();
  o.run_id = run_id;
  return std::make_unique<launch::NodeGroup>(o);
}

int run_launch(const LaunchCommand& c) {
  check_command(c);
  const bool several = c.nnodes > 1;
  // Every node's ranks must present the same token, so none is drawn for several.
  const std::string token = several ? env_or("QUANTA_JOB_TOKEN", "") : job_token();
  // One id for the job, the same in every attempt (on several nodes, node 0's).
  std::string run_id = env_or("QUANTA_RUN_ID", random_hex(2));
  std::unique_ptr<launch::NodeGroup> nodes;
  if (several) {
    nodes = join_nodes(c, token, run_id);
    run_id = nodes->run_id();
  }
  // After joining: until then the default action (exit) is the right one.
  launch::catch_stop_signals();
  const std::string tag = several ? nodes->tag() : "[launch]";
  for (int attempt = 0;; ++attempt) {
    int port = 0;
    if (several) {
      port = nodes->ranks_port(attempt);
      if (port == 0) return 128 + launch::stop_signal();  // stopped while waiting for node 0
    } else {
      // A fresh port per attempt: nothing of a failed attempt can reach the next.
      port = c.master_port ? c.master_port : launch::free_port();
    }
    launch::AttemptOptions opts;
    opts.program = c.program;
    opts.tag = tag;
    if (several) {
      launch::NodeGroup& g = *nodes;
      opts.poll_peers = [&g, attempt] { return g.poll(attempt); };
      opts.on_failure = [&g, attempt](int, const std::string& what, int status) {
        g.report_failure(attempt, what, status);
      };
      opts.on_stop = [&g, attempt](int sig) { g.report_stop(attempt, sig); };
    }
    const launch::AttemptResult local =
        launch::run_attempt(rank_starts(c, port, attempt, token, run_id), opts);
    launch::Outcome o;
    if (several) {
      o = nodes->finish(attempt, local);
    } else {
      o.status = local.status;
      o.failure = local.failure;
      o.stopped = local.stop_signal != 0;
    }
    // One node: a signal that came after the attempt ended stops the job too.
    // Several: only what every node read decides, so they stay together (a
    // late signal stops the next attempt at once).
    const bool stopped = o.stopped || (!several && launch::stop_signal() != 0);
    if (o.status == 0 || stopped || attempt >= c.max_restarts) {
      if (several) nodes->close(attempt);
      if (o.status != 0 && !stopped && c.max_restarts > 0)
        std::fprintf(stderr, "%s %s in attempt %d of %d; no restarts left (--max-restarts %d)\n",
                     tag.c_str(), o.failure.c_str(), attempt + 1, c.max_restarts + 1,
                     c.max_restarts);
      else if (o.status != 0 && several && local.failed_rank < 0 && !o.failure.empty())
        std::fprintf(stderr, "%s %s\n", tag.c_str(), o.failure.c_str());
      return o.status;
    }
    say_restart(tag, o, attempt, c.max_restarts);
  }
}

// torchrun's elastic range "MIN:MAX" for --nnodes gets its own message.
CLI::Validator no_node_range() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        if (s.find(':') == std::string::npos) return "";
        return "elastic ranges (torchrun's MIN:MAX) are not supported: give the number of "
               "nodes, got '" +
               s + "'";
      },
      "");
}

}  // namespace

void add_launch(CLI::App& app) {
  auto c = std::make_shared<LaunchCommand>();
  CLI::App* sub = app.add_subcommand(
      "launch",
      "Start the ranks of PROGRAM with torchrun's environment, on one node or several, "
      "restarting them after a failure with --max-restarts (quanta launch -n 2 -- prog args)");
  sub->add_option("-n,--nproc,--nproc-per-node,--nproc_per_node", c->nproc, "ranks on this node")
      ->capture_default_str()
      ->transform(integer_in(1, train::kMaxRanks));
  sub->add_option("--max-restarts,--max_restarts", c->max_restarts,
                  "start every rank again after a failure, up to this many times; each "
                  "restart gets a fresh rendezvous and QUANTA_RESTART_COUNT")
      ->capture_default_str()
      ->transform(integer_in(0, kMaxRestarts));
  sub->add_option("--nnodes", c->nnodes, "nodes of the job (one quanta launch on each)")
      ->capture_default_str()
      ->transform(integer_in(1, train::kMaxRanks))
      ->transform(no_node_range());  // CLI11 runs the last transform added first
  sub->add_option("--node-rank,--node_rank", c->node_rank, "this node's rank, 0 to --nnodes - 1")
      ->capture_default_str()
      ->transform(integer_in(0, train::kMaxRanks - 1));
  sub->add_option("--master-addr,--master_addr", c->master_addr,
                  "address of node 0, where the rendezvous is (MASTER_ADDR of the ranks)")
      ->capture_default_str();
  sub->add_option("--master-port,--master_port", c->master_port,
                  "port of the rendezvous on node 0 (default: a free port on one node, "
                  "29500 on several)")
      ->transform(integer_in(1, 65535));
  add_dist_timeout_flag(*sub, c->dist_timeout);
  sub->add_option("program", c->program, "the program and its arguments (after --)")->required();
  sub->footer(
      "Examples:\n"
      "  quanta launch -n 2 -- quanta train --steps 200 --out runs/two   # what --nproc 2 runs\n"
      "  quanta launch -n 4 --dist-timeout 600 -- ./my_program --flag\n"
      "  quanta launch -n 2 --max-restarts 3 -- quanta train --out runs/elastic\n"
      "  # two machines, 4 ranks each: one command on each machine\n"
      "  quanta launch --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 -n 4 "
      "-- ./prog\n"
      "  quanta launch --nnodes 2 --node-rank 1 --master-addr node0 --master-port 29500 -n 4 "
      "-- ./prog\n"
      "Each rank gets RANK (node rank x ranks per node + local rank), LOCAL_RANK, WORLD_SIZE, "
      "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, QUANTA_JOB_TOKEN (random per job "
      "on one node unless set; on several nodes set the same secret on each), "
      "QUANTA_RESTART_COUNT, QUANTA_MAX_RESTARTS and QUANTA_RUN_ID (also as torchrun's "
      "TORCHELASTIC_*), and OMP_NUM_THREADS=1 unless set. Output lines are prefixed with "
      "[rank R]. When a rank fails, the others are stopped (on every node); with "
      "--max-restarts N all are started again, up to N times (quanta train continues its run "
      "from --out). quanta launch exits 0 when the last attempt succeeded, "
      "else with the failing rank's status. On SIGINT or SIGTERM the ranks get SIGTERM and "
      "nothing restarts; quanta launch exits 0 when every rank then exits 0. Ranks are killed "
      "when quanta launch dies. Several nodes: node 0 hosts the rendezvous at --master-addr:"
      "--master-port and picks a free port for the ranks' store at each attempt; every node "
      "needs the same --nnodes, --nproc-per-node and --max-restarts. See docs/dist.md.");
  sub->callback([c] {
    apply_dist_timeout(c->dist_timeout);
    const int code = run_launch(*c);
    std::fflush(stdout);
    std::fflush(stderr);
    if (code != 0) std::exit(code);
  });
}

}  // namespace quanta::cli
