#pragma once
// The launchers of a job on several nodes (`quanta launch --nnodes M`) and
// how they agree, torchrun-style: node 0's launcher hosts a store at
// --master-addr:--master-port that every launcher joins. Through it they
// check that they were started alike (same --nnodes, --nproc-per-node,
// --max-restarts; each node rank once), share the job's run id, and agree
// on every attempt: node 0 picks a fresh port for that attempt's rank store
// (rank 0 hosts it), a failure or a stop signal on any node stops the ranks
// of every node, and all launchers wait for each other at the end of the
// attempt, so they all read the same outcome and restart (or not) together.
#include <memory>
#include <string>

#include "dist/store/store.h"
#include "launch/local_ranks.h"

namespace quanta::cli::launch {

/** Where and how a node joins the job. */
struct NodeGroupOptions {
  int nnodes = 2;
  int node_rank = 0;
  int nproc_per_node = 1;
  int max_restarts = 0;
  std::string master_addr;
  int master_port = 29500;
  /** QUANTA_JOB_TOKEN; empty: the store's fixed default token. */
  std::string token{};
  /** QUANTA_STORE_BIND_ALL: node 0's store listens on every interface. */
  bool bind_all = false;
  /** For joining and for the launchers' wait at the end of an attempt. */
  dist::Millis timeout{300000};
  /** The run id node 0 proposes (the others take node 0's). */
  std::string run_id{};
};

/** What every launcher reads at the end of an attempt. */
struct Outcome {
  /** 0: every rank of every node exited 0; else the failing rank's status. */
  int status = 0;
  /** The first failure ("rank 3 on node 1 exited with status 7"); empty when none. */
  std::string failure{};
  /** A stop signal (or a node refusing to join) ended the attempt: no restart. */
  bool stopped = false;
};

/** dist::free_port() (rank 0's store binds the port moments later); throws
 * std::runtime_error suggesting --master-port when there is none. */
int free_port();

/** This launcher's place among the launchers of the job. */
class NodeGroup {
 public:
  /** Joins (node 0: hosts) the launchers' store and checks this node's
   * settings against node 0's; throws std::runtime_error naming what
   * differs, a node rank started twice, or a store it cannot reach. */
  explicit NodeGroup(const NodeGroupOptions& opts);
  ~NodeGroup();
  NodeGroup(const NodeGroup&) = delete;
  NodeGroup& operator=(const NodeGroup&) = delete;

  /** The job's run id (node 0's). */
  const std::string& run_id() const { return run_id_; }
  /** "[launch node R]". */
  std::string tag() const;

  /** The port of attempt `attempt`'s rank store: a free port chosen by
   * node 0, read from the store by the others. */
  int ranks_port(int attempt);
  /** What the other nodes said during attempt `attempt`. */
  PeerNews poll(int attempt);
  /** Tells the other nodes that a rank of this node failed. */
  void report_failure(int attempt, const std::string& what, int status);
  /** Tells the other nodes that this launcher got a stop signal. */
  void report_stop(int attempt, int sig);
  /** Reports how the attempt ended here, waits for every node to do the
   * same and returns the outcome they all read. Throws std::runtime_error
   * when a node does not report within the timeout or the store is lost. */
  Outcome finish(int attempt, const AttemptResult& local);
  /** The last attempt is over: node 0 keeps its store up until every node
   * has read the outcome (at most a few seconds). */
  void close(int attempt);

 private:
  std::string key(int attempt, const std::string& name) const;
  [[noreturn]] void abort_job(const std::string& why);
  NodeGroupOptions opts_;
  std::unique_ptr<dist::TcpStore> store_;
  std::string run_id_;
  std::string lost_;      // why the store stopped answering during poll()
  bool aborted_ = false;  // a node refused to join: the job ends
};

}  // namespace quanta::cli::launch
