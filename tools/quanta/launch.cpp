// `quanta launch -n N [--master-port P] -- PROGRAM ARGS...`: starts N local
// ranks with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; OMP_NUM_THREADS=1 unless set) plus a
// random QUANTA_JOB_TOKEN for the rank-0 store,
// prefixes every line they print with "[rank R] ", and when a rank fails
// stops the others (SIGTERM, then SIGKILL after a grace period) and exits
// with the failing rank's status (128 + signal for a rank killed by one).
// SIGINT / SIGTERM are passed on to the ranks as SIGTERM; it then exits 0
// when every rank exits 0. Ranks die with it (PR_SET_PDEATHSIG).
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "commands.h"
#include "dist_timeout.h"
#include "flag_checks.h"
#include "train/limits.h"

extern char** environ;

namespace quanta::cli {
namespace {

// The signal that asked the launcher to stop (Ctrl-C, a job scheduler's
// SIGTERM); the main loop passes it on to every rank. A signal handler can
// only talk through a variable like this one.
volatile std::sig_atomic_t g_stop_signal = 0;

void on_stop_signal(int sig) { g_stop_signal = sig; }

struct LaunchCommand {
  int n = 1;
  int master_port = 0;
  std::string dist_timeout;  // seconds; empty: the library's default
  std::vector<std::string> program;
};

// A port nobody listens on now (the store server binds it moments later).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    throw std::runtime_error("quanta launch: cannot find a free port; pass --master-port");
  ::close(fd);
  return ntohs(addr.sin_port);
}

// The job's shared secret for the rank-0 store (QUANTA_JOB_TOKEN): 128
// random bits, so a process outside this job cannot join it or write to its
// store. One already in the environment is kept (several launchers, one job).
std::string job_token() {
  if (const char* t = std::getenv("QUANTA_JOB_TOKEN"); t && *t) return t;
  std::random_device rd;
  std::string token;
  for (int i = 0; i < 4; ++i) {
    char word[9];
    std::snprintf(word, sizeof word, "%08x", static_cast<unsigned>(rd()));
    token += word;
  }
  return token;
}

struct Rank {
  pid_t pid = -1;
  int out = -1, err = -1;  // read ends of its stdout / stderr pipes
  std::string out_buf, err_buf;
  bool running = true;
  int status = 0;  // exit code, or 128 + signal
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

pid_t spawn_rank(const LaunchCommand& c, int rank, int port, const std::string& token, int out_w,
                 int err_w) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    if (key == "RANK" || key == "LOCAL_RANK" || key == "WORLD_SIZE" || key == "LOCAL_WORLD_SIZE" ||
        key == "MASTER_ADDR" || key == "MASTER_PORT" || key == "GROUP_RANK" || key == "ROLE_RANK" ||
        key == "QUANTA_JOB_TOKEN")
      continue;
    env.push_back(kv);
  }
  const std::string n = std::to_string(c.n), r = std::to_string(rank);
  for (const std::string& kv : std::vector<std::string>{
           "RANK=" + r, "LOCAL_RANK=" + r, "GROUP_RANK=0", "ROLE_RANK=" + r, "WORLD_SIZE=" + n,
           "LOCAL_WORLD_SIZE=" + n, std::string("MASTER_ADDR=127.0.0.1"),
           "MASTER_PORT=" + std::to_string(port), "QUANTA_JOB_TOKEN=" + token})
    env.push_back(kv);
  // N ranks each with a full OpenMP pool oversubscribe the cores (torchrun too).
  if (!std::getenv("OMP_NUM_THREADS") && c.n > 1) env.push_back("OMP_NUM_THREADS=1");
  std::vector<char*> envp, argv;
  for (auto& kv : env) envp.push_back(kv.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = c.program;
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
    throw std::runtime_error("quanta launch: cannot start '" + c.program[0] +
                             "': " + std::strerror(e));
  }
  return pid;
}

int run_launch(const LaunchCommand& c) {
  if (c.program.empty()) throw UsageError("quanta launch: give the program after --");
  const int port = c.master_port ? c.master_port : free_port();
  const std::string token = job_token();
  std::vector<Rank> ranks(c.n);
  for (int r = 0; r < c.n; ++r) {
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0)
      throw std::runtime_error("quanta launch: pipe() failed");
    try {
      ranks[r].pid = spawn_rank(c, r, port, token, out[1], err[1]);
    } catch (...) {
      for (int k = 0; k < r; ++k) ::kill(-ranks[k].pid, SIGKILL);
      throw;
    }
    ::close(out[1]);
    ::close(err[1]);
    ranks[r].out = out[0];
    ranks[r].err = err[0];
  }
  using Clock = std::chrono::steady_clock;
  int failed = -1;
  Clock::time_point kill_at{};
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
  bool forwarded = false;
  for (;;) {
    if (g_stop_signal && !forwarded) {
      forwarded = true;
      std::fprintf(stderr, "[launch] got signal %d; stopping the ranks\n", int(g_stop_signal));
      for (auto& o : ranks)
        if (o.running) ::kill(-o.pid, SIGTERM);
      kill_at = Clock::now() + std::chrono::seconds(5);
    }
    std::vector<pollfd> fds;
    std::vector<std::pair<int, bool>> who;  // (rank, is_err)
    for (int r = 0; r < c.n; ++r) {
      if (ranks[r].out >= 0) fds.push_back({ranks[r].out, POLLIN, 0}), who.push_back({r, false});
      if (ranks[r].err >= 0) fds.push_back({ranks[r].err, POLLIN, 0}), who.push_back({r, true});
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
        flush_lines(b, to, who[i].first, false);
      } else {
        flush_lines(b, to, who[i].first, true);
        ::close(fds[i].fd);
        (is_err ? rk.err : rk.out) = -1;
      }
    }
    bool any_running = false;
    for (int r = 0; r < c.n; ++r) {
      Rank& rk = ranks[r];
      if (!rk.running) continue;
      int st = 0;
      if (::waitpid(rk.pid, &st, WNOHANG) == rk.pid) {
        rk.running = false;
        rk.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (rk.status != 0 && failed < 0 && !forwarded) {
          failed = r;
          std::fprintf(stderr, "[launch] rank %d exited with status %d; stopping the other ranks\n",
                       r, rk.status);
          for (auto& o : ranks)
            if (o.running) ::kill(-o.pid, SIGTERM);
          kill_at = Clock::now() + std::chrono::seconds(5);
        }
      } else {
        any_running = true;
      }
    }
    if ((failed >= 0 || forwarded) && any_running && Clock::now() > kill_at)
      for (auto& o : ranks)
        if (o.running) ::kill(-o.pid, SIGKILL);
    bool pipes_open = false;
    for (auto& rk : ranks) pipes_open = pipes_open || rk.out >= 0 || rk.err >= 0;
    if (!any_running && !pipes_open) break;
    if (!any_running && (failed >= 0 || forwarded) && Clock::now() > kill_at)
      break;  // orphaned writers
  }
  if (failed >= 0) return ranks[failed].status;
  // Stopped by a signal (a scheduler preempting the job): success when every
  // rank stopped cleanly (quanta train writes its checkpoint and exits 0),
  // else the first rank's status, as when a rank fails.
  for (const Rank& rk : ranks)
    if (rk.status != 0) return rk.status;
  return 0;
}

}  // namespace

void add_launch(CLI::App& app) {
  auto c = std::make_shared<LaunchCommand>();
  CLI::App* sub = app.add_subcommand("launch",
                                     "Start N local ranks of PROGRAM with torchrun's environment "
                                     "(quanta launch -n 2 -- prog args)");
  sub->add_option("-n,--nproc", c->n, "number of ranks")
      ->capture_default_str()
      ->transform(integer_in(1, train::kMaxRanks));
  sub->add_option("--master-port", c->master_port,
                  "port of the rank-0 store (default: a free port)")
      ->transform(integer_in(1, 65535));
  add_dist_timeout_flag(*sub, c->dist_timeout);
  sub->add_option("program", c->program, "the program and its arguments (after --)")->required();
  sub->footer(
      "Examples:\n"
      "  quanta launch -n 2 -- quanta train --steps 200 --out runs/two   # what --nproc 2 runs\n"
      "  quanta launch -n 4 --dist-timeout 600 -- ./my_program --flag\n"
      "Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, "
      "MASTER_PORT and QUANTA_JOB_TOKEN (random per job unless set; the store refuses "
      "processes without it) (and OMP_NUM_THREADS=1 unless set). Output lines are prefixed with "
      "[rank R]. When a rank fails, the others are stopped and quanta launch exits with the "
      "failing rank's status. On SIGINT or SIGTERM the ranks get SIGTERM; quanta launch "
      "exits 0 when every rank then exits 0. Ranks are killed when quanta launch dies.");
  sub->callback([c] {
    apply_dist_timeout(c->dist_timeout);
    const int code = run_launch(*c);
    std::fflush(stdout);
    std::fflush(stderr);
    if (code != 0) std::exit(code);
  });
}

}  // namespace quanta::cli
