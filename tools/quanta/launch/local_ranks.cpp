#include "launch/local_ranks.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <set>
#include <stdexcept>

extern char** environ;

namespace quanta::cli::launch {
namespace {

using Clock = std::chrono::steady_clock;

// Time a rank has to exit after SIGTERM before it gets SIGKILL.
constexpr auto kGrace = std::chrono::seconds(5);
// How often the other nodes are asked for news while ranks run.
constexpr auto kPollPeers = std::chrono::milliseconds(100);

// The signal that asked the launcher to stop (Ctrl-C, a job scheduler's
// SIGTERM); the watch loop passes it on to every rank. A signal handler can
// only talk through a variable like this one.
volatile std::sig_atomic_t g_stop_signal = 0;

void on_stop_signal(int sig) { g_stop_signal = sig; }

struct Rank {
  int rank = 0;
  pid_t pid = -1;
  int out = -1, err = -1;  // read ends of its stdout / stderr pipes
  std::string out_buf, err_buf;
  bool running = true;
  int status = 0;   // exit code, or 128 + signal
  std::string how;  // "exited with status 7", "was killed by signal 9 (Killed)"
};

// Writes the complete lines of `buf` to `to` with the rank prefix; with
// `all`, the unterminated rest too.
void flush_lines(std::string& buf, FILE* to, int rank, bool all) {
  std::size_t start = 0;
  for (std::size_t nl; (nl = buf.find('\n', start)) != std::string::npos; start = nl + 1)
    std::fprintf(to, "[rank %d] %.*s\n", rank, int(nl - start), buf.data() + start);
  buf.erase(0, start);
  if (all && !buf.empty()) {
    std::fprintf(to, "[rank %d] %s\n", rank, buf.c_str());
    buf.clear();
  }
  std::fflush(to);
}

std::string key_of(const std::string& kv) { return kv.substr(0, kv.find('=')); }

pid_t spawn_rank(const std::vector<std::string>& program, const RankStart& start, int out_w,
                 int err_w) {
  std::set<std::string> replaced;
  for (const std::string& kv : start.env) replaced.insert(key_of(kv));
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e)
    if (!replaced.count(key_of(*e))) env.push_back(*e);
  env.insert(env.end(), start.env.begin(), start.env.end());
  std::vector<char*> envp, argv;
  for (auto& kv : env) envp.push_back(kv.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = program;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  // fork + exec rather than posix_spawn, for what only the child can do
  // before exec: its own process group (stopping a rank stops its children)
  // and death with the launcher. PR_SET_PDEATHSIG (kept across exec) has the
  // kernel SIGKILL the rank when the thread that forked it dies, so a
  // launcher killed outright (SIGKILL, the OOM killer) leaves no rank running
  // under PID 1; quanta launch forks from its only thread. A launcher that
  // died before prctl took effect is caught by getppid(). Between fork and
  // exec only async-signal-safe calls.
  const pid_t launcher = ::getpid();
  int exec_error[2];  // the child writes errno here when exec fails
  if (::pipe2(exec_error, O_CLOEXEC) != 0) throw std::runtime_error("quanta launch: pipe() failed");
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(exec_error[0]);
    ::close(exec_error[1]);
    throw std::runtime_error("quanta launch: fork() failed: " + std::string(std::strerror(errno)));
  }
  if (pid == 0) {
    ::setpgid(0, 0);
    if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != launcher) ::_exit(127);
    if (::dup2(out_w, 1) < 0 || ::dup2(err_w, 2) < 0) ::_exit(127);
    ::execvpe(argv[0], argv.data(), envp.data());
    const int e = errno;
    [[maybe_unused]] const ssize_t w = ::write(exec_error[1], &e, sizeof e);
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // from this side too, so kill(-pid) works at once
  ::close(exec_error[1]);
  int e = 0;
  ssize_t k;
  while ((k = ::read(exec_error[0], &e, sizeof e)) < 0 && errno == EINTR) {
  }
  ::close(exec_error[0]);
  if (k == sizeof e) {  // exec failed (end of file instead: it succeeded)
    ::waitpid(pid, nullptr, 0);
    throw std::runtime_error("quanta launch: cannot start '" + program[0] +
                             "': " + std::strerror(e));
  }
  return pid;
}

// "exited with status 7" / "was killed by signal 9 (Killed)", and the status
// quanta launch reports for it (128 + signal for a signal).
void record_exit(Rank& rk, int wait_status) {
  if (WIFSIGNALED(wait_status)) {
    const int sig = WTERMSIG(wait_status);
    rk.status = 128 + sig;
    rk.how = "was killed by signal ";
    rk.how += std::to_string(sig);
    rk.how += " (";
    rk.how += strsignal(sig);
    rk.how += ")";
  } else {
    rk.status = WEXITSTATUS(wait_status);
    rk.how = "exited with status ";
    rk.how += std::to_string(rk.status);
  }
}

}  // namespace

void catch_stop_signals() {
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
}

int stop_signal() { return g_stop_signal; }

AttemptResult run_attempt(const std::vector<RankStart>& starts, const AttemptOptions& opts) {
  const int n = static_cast<int>(starts.size());
  std::vector<Rank> ranks(n);
  for (int i = 0; i < n; ++i) {
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0)
      throw std::runtime_error("quanta launch: pipe() failed");
    ranks[i].rank = starts[i].rank;
    try {
      ranks[i].pid = spawn_rank(opts.program, starts[i], out[1], err[1]);
    } catch (...) {
      for (int k = 0; k < i; ++k) ::kill(-ranks[k].pid, SIGKILL);
      for (int k = 0; k < i; ++k) ::waitpid(ranks[k].pid, nullptr, 0);
      throw;
    }
    ::close(out[1]);
    ::close(err[1]);
    ranks[i].out = out[0];
    ranks[i].err = err[0];
  }

  AttemptResult result;
  Rank* failed = nullptr;
  // Once stopping (a failure, a signal, news from another node), later exits
  // are consequences, not failures of their own.
  bool stopping = false;
  Clock::time_point kill_at{};
  auto stop_all = [&] {
    stopping = true;
    for (auto& o : ranks)
      if (o.running) ::kill(-o.pid, SIGTERM);
    kill_at = Clock::now() + kGrace;
  };
  Clock::time_point next_poll = Clock::now();
  for (;;) {
    if (g_stop_signal && !result.stop_signal && !stopping) {
      result.stop_signal = g_stop_signal;
      std::fprintf(stderr, "%s got signal %d; stopping the ranks\n", opts.tag.c_str(),
                   int(g_stop_signal));
      if (opts.on_stop) opts.on_stop(result.stop_signal);
      stop_all();
    }
    if (opts.poll_peers && !stopping && Clock::now() >= next_poll) {
      next_poll = Clock::now() + kPollPeers;
      const PeerNews news = opts.poll_peers();
      if (news.state != PeerNews::State::running) {
        result.stopped_by_peer = true;
        std::fprintf(stderr, "%s %s; stopping the ranks of this node\n", opts.tag.c_str(),
                     news.what.c_str());
        stop_all();
      }
    }
    std::vector<pollfd> fds;
    std::vector<std::pair<int, bool>> who;  // (index, is_err)
    for (int i = 0; i < n; ++i) {
      if (ranks[i].out >= 0) fds.push_back({ranks[i].out, POLLIN, 0}), who.push_back({i, false});
      if (ranks[i].err >= 0) fds.push_back({ranks[i].err, POLLIN, 0}), who.push_back({i, true});
    }
    if (!fds.empty()) ::poll(fds.data(), fds.size(), 50);
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      Rank& rk = ranks[who[i].first];
      const bool is_err = who[i].second;
      char buf[4096];
      const ssize_t k = ::read(fds[i].fd, buf, sizeof buf);
      std::string& b = is_err ? rk.err_buf : rk.out_buf;
      FILE* to = is_err ? stderr : stdout;
      if (k > 0) {
        b.append(buf, static_cast<std::size_t>(k));
        flush_lines(b, to, rk.rank, false);
      } else {
        flush_lines(b, to, rk.rank, true);
        ::close(fds[i].fd);
        (is_err ? rk.err : rk.out) = -1;
      }
    }
    bool any_running = false;
    for (Rank& rk : ranks) {
      if (!rk.running) continue;
      int st = 0;
      if (::waitpid(rk.pid, &st, WNOHANG) != rk.pid) {
        any_running = true;
        continue;
      }
      rk.running = false;
      record_exit(rk, st);
      if (rk.status != 0 && !stopping) {
        failed = &rk;
        std::fprintf(stderr, "%s rank %d %s; stopping the other ranks\n", opts.tag.c_str(), rk.rank,
                     rk.how.c_str());
        if (opts.on_failure)
          opts.on_failure(rk.rank, "rank " + std::to_string(rk.rank) + " " + rk.how, rk.status);
        stop_all();
      }
    }
    if (stopping && any_running && Clock::now() > kill_at)
      for (auto& o : ranks)
        if (o.running) ::kill(-o.pid, SIGKILL);
    bool pipes_open = false;
    for (auto& rk : ranks) pipes_open = pipes_open || rk.out >= 0 || rk.err >= 0;
    if (!any_running && !pipes_open) break;
    if (!any_running && stopping && Clock::now() > kill_at) break;  // orphaned writers
  }
  for (Rank& rk : ranks) {
    // What a stopped rank left behind (a child of a shell wrapper) must not
    // outlive the attempt: it could still write to the run a restart reads.
    if (stopping) ::kill(-rk.pid, SIGKILL);
    if (rk.out >= 0) ::close(rk.out);
    if (rk.err >= 0) ::close(rk.err);
  }
  if (failed) {
    result.failed_rank = failed->rank;
    result.failure = "rank " + std::to_string(failed->rank) + " " + failed->how;
    result.status = failed->status;
    return result;
  }
  // Stopped by a signal (a scheduler preempting the job) or by another node:
  // success when every rank stopped cleanly (quanta train writes its
  // checkpoint and exits 0), else the first rank's status.
  for (const Rank& rk : ranks)
    if (rk.status != 0) {
      result.status = rk.status;
      break;
    }
  return result;
}

}  // namespace quanta::cli::launch
