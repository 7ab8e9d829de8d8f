#include "launch/node_group.h"

#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <thread>

#include "dist/store/wait_report.h"

namespace quanta::cli::launch {
namespace {

using Clock = std::chrono::steady_clock;
using dist::Millis;

// Keys of the launchers' store that are not per attempt.
constexpr const char* kSettings = "launch/settings";
constexpr const char* kRunId = "launch/run_id";
constexpr const char* kAbort = "launch/abort";           // why the job cannot run at all
constexpr const char* kAborting = "launch/aborting";     // nodes that refused to join
constexpr const char* kAbortSeen = "launch/abort_seen";  // nodes that read why

std::string settings_text(const NodeGroupOptions& o) {
  std::string s = "--nnodes ";
  s += std::to_string(o.nnodes);
  s += " --nproc-per-node ";
  s += std::to_string(o.nproc_per_node);
  s += " --max-restarts ";
  s += std::to_string(o.max_restarts);
  return s;
}

// "node 1" / "nodes 1, 3".
std::string node_list(const std::vector<int>& nodes) {
  std::string s = nodes.size() == 1 ? "node " : "nodes ";
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(nodes[i]);
  }
  return s;
}

}  // namespace

int free_port() {
  try {
    return dist::free_port();
  } catch (const std::runtime_error&) {
    // The launcher's users can choose the port themselves: say how.
    throw std::runtime_error("quanta launch: cannot find a free port; pass --master-port");
  }
}

NodeGroup::NodeGroup(const NodeGroupOptions& opts) : opts_(opts) {
  dist::TcpStoreOptions store_opts;
  if (!opts.token.empty()) store_opts.token = opts.token;
  if (opts.bind_all) store_opts.bind = "0.0.0.0";
  store_opts.server_owner = "node 0's quanta launch (--node-rank 0)";
  const bool host = opts.node_rank == 0;
  store_ = std::make_unique<dist::TcpStore>(opts.master_addr, opts.master_port, host, opts.timeout,
                                            store_opts);
  if (host) {
    store_->set_string(kSettings, settings_text(opts));
    store_->set_string(kRunId, opts.run_id);
  }
  const std::string me = "node " + std::to_string(opts.node_rank);
  // The second launcher of a node rank fails alone: the job (perhaps already
  // running) is the first one's.
  if (store_->add("launch/node/" + std::to_string(opts.node_rank), 1) > 1)
    throw std::runtime_error("quanta launch: " + me + " joined " + store_->describe() +
                             " twice: start one quanta launch per --node-rank");
  const std::string theirs = store_->get_string(kSettings, opts.timeout);
  const std::string mine = settings_text(opts);
  if (theirs != mine)
    abort_job(me + " was started with " + mine + " but node 0 with " + theirs +
              ": start every node with the same --nnodes, --nproc-per-node and --max-restarts");
  run_id_ = store_->get_string(kRunId, opts.timeout);
}

NodeGroup::~NodeGroup() = default;

std::string NodeGroup::tag() const {
  return "[launch node " + std::to_string(opts_.node_rank) + "]";
}

std::string NodeGroup::key(int attempt, const std::string& name) const {
  return "launch/attempt/" + std::to_string(attempt) + "/" + name;
}

void NodeGroup::abort_job(const std::string& why) {
  // Every other launcher reads this at its next poll and stops its ranks.
  try {
    store_->add(kAborting, 1);
    if (!store_->check(kAbort)) store_->set_string(kAbort, why);
  } catch (const std::exception&) {
  }
  throw std::runtime_error("quanta launch: " + why);
}

int NodeGroup::ranks_port(int attempt) {
  const std::string k = key(attempt, "port");
  if (opts_.node_rank == 0) {
    const int port = free_port();
    store_->set_string(k, std::to_string(port));
    return port;
  }
  const auto deadline = Clock::now() + opts_.timeout;
  while (!store_->check(k)) {
    if (store_->check(kAbort)) {
      const std::string why = store_->get_string(kAbort, Millis(1000));
      store_->add(kAbortSeen, 1);
      throw std::runtime_error("quanta launch: " + why);
    }
    if (stop_signal()) return 0;
    if (Clock::now() > deadline)
      throw std::runtime_error("quanta launch: node 0 did not start attempt " +
                               std::to_string(attempt + 1) + " within the timeout");
    std::this_thread::sleep_for(Millis(50));
  }
  return std::stoi(store_->get_string(k, Millis(1000)));
}

PeerNews NodeGroup::poll(int attempt) {
  PeerNews news;
  try {
    if (store_->check(kAbort)) {
      news.state = PeerNews::State::failed;
      news.what = store_->get_string(kAbort, Millis(1000));
    } else if (store_->check(key(attempt, "failure"))) {
      news.state = PeerNews::State::failed;
      const std::string f = store_->get_string(key(attempt, "failure"), Millis(1000));
      news.what = f.substr(f.find(' ') + 1);
    } else if (store_->check(key(attempt, "stop"))) {
      news.state = PeerNews::State::stopping;
      news.what = store_->get_string(key(attempt, "stop"), Millis(1000));
    }
  } catch (const std::exception& e) {
    lost_ = e.what();
    news.state = PeerNews::State::failed;
    news.what = "lost the launchers' store (node 0's launcher exited?)";
  }
  return news;
}

void NodeGroup::report_failure(int attempt, const std::string& what, int status) {
  try {
    // The first failure of the attempt is the one every node reports.
    if (store_->add(key(attempt, "failures"), 1) == 1)
      store_->set_string(
          key(attempt, "failure"),
          std::to_string(status) + " " + what + " on node " + std::to_string(opts_.node_rank));
  } catch (const std::exception& e) {
    lost_ = e.what();
  }
}

void NodeGroup::report_stop(int attempt, int sig) {
  try {
    store_->set_string(key(attempt, "stop"), "node " + std::to_string(opts_.node_rank) +
                                                 " got signal " + std::to_string(sig));
  } catch (const std::exception& e) {
    lost_ = e.what();
  }
}

Outcome NodeGroup::finish(int attempt, const AttemptResult& local) {
  const std::string where = store_->describe();
  if (!lost_.empty())
    throw std::runtime_error("quanta launch: lost the launchers' store at " + where + ": " + lost_);
  Outcome o;
  try {
    store_->set_string(key(attempt, "status/" + std::to_string(opts_.node_rank)),
                       std::to_string(local.status));
    store_->add(key(attempt, "done"), 1);
    const auto deadline = Clock::now() + opts_.timeout;
    dist::detail::WaitReport report(opts_.timeout);
    for (;;) {
      if (store_->check(kAbort)) {
        o.status = 1;
        o.failure = store_->get_string(kAbort, Millis(1000));
        o.stopped = true;
        aborted_ = true;
        store_->add(kAbortSeen, 1);
        return o;
      }
      if (store_->add(key(attempt, "done"), 0) >= opts_.nnodes) break;
      const bool late = Clock::now() > deadline;
      if (late || report.due()) {
        std::vector<int> missing;
        for (int r = 0; r < opts_.nnodes; ++r)
          if (!store_->check(key(attempt, "status/" + std::to_string(r)))) missing.push_back(r);
        if (late)
          throw std::runtime_error("quanta launch: " + node_list(missing) +
                                   " did not finish attempt " + std::to_string(attempt + 1) +
                                   " within the timeout: is its quanta launch running?");
        std::fprintf(stderr, "%s waiting for %s to finish attempt %d (%s)\n", tag().c_str(),
                     node_list(missing).c_str(), attempt + 1, report.waited().c_str());
      }
      std::this_thread::sleep_for(Millis(50));
    }
    if (store_->check(key(attempt, "failure"))) {
      const std::string f = store_->get_string(key(attempt, "failure"), Millis(1000));
      o.status = std::stoi(f.substr(0, f.find(' ')));
      o.failure = f.substr(f.find(' ') + 1);
    } else {
      for (int r = 0; r < opts_.nnodes && o.status == 0; ++r)
        o.status = std::stoi(
            store_->get_string(key(attempt, "status/" + std::to_string(r)), Millis(1000)));
    }
    o.stopped = store_->check(key(attempt, "stop"));
    store_->add(key(attempt, "seen"), 1);
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    if (what.rfind("quanta launch: ", 0) == 0) throw;
    throw std::runtime_error("quanta launch: lost the launchers' store at " + where + ": " + what);
  }
  return o;
}

void NodeGroup::close(int attempt) {
  if (opts_.node_rank != 0) return;
  // The others read the outcome right after the last node reported: wait
  // for them briefly, so none finds the store gone.
  // After an abort, the nodes that refused to join read nothing more.
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  auto all_read = [&] {
    return aborted_ ? store_->add(kAbortSeen, 0) + store_->add(kAborting, 0) >= opts_.nnodes
                    : store_->add(key(attempt, "seen"), 0) >= opts_.nnodes;
  };
  try {
    while (!all_read() && Clock::now() < deadline) std::this_thread::sleep_for(Millis(20));
  } catch (const std::exception&) {
  }
}

}  // namespace quanta::cli::launch
