// Ranks as real processes: a rank that dies, the launcher (`quanta launch`),
// and reading the launchers' environments. RANK_PROGRAM is
// tests/dist/rank_program.cpp; QUANTA_EXE the quanta command.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dist/env.h"
#include "dist/store/store.h"
#include "support/spawn.h"

using namespace quanta::dist;

extern char** environ;

namespace {

std::string env_or_skip(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

struct Run {
  int status = -1;
  std::string out;
};

// Runs argv with extra environment entries, stdout+stderr to a file.
pid_t spawn(const std::vector<std::string>& args, const std::vector<std::string>& extra_env,
            const std::string& out_path) {
  return quanta::testing::spawn_process(args, extra_env, out_path);
}

Run finish(pid_t pid, const std::string& out_path) {
  Run r;
  int st = 0;
  ::waitpid(pid, &st, 0);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  std::ifstream in(out_path);
  std::stringstream ss;
  ss << in.rdbuf();
  r.out = ss.str();
  return r;
}

std::string tmp_path(const std::string& name) {
  return "/tmp/quanta_dist_test_" + std::to_string(::getpid()) + "_" + name;
}

}  // namespace

namespace {
// Three ranks of the rank program's `scenario`, in which rank 1 exits with
// status 3: both survivors must fail naming it as dead (the store posts its
// status when its connection ends), within `most_ms`.
void check_survivors_name_rank_1(const std::string& prog, const std::string& scenario,
                                 long most_ms) {
  const int port = free_port();
  std::vector<pid_t> pids;
  for (int r = 0; r < 3; ++r)
    pids.push_back(spawn({prog, scenario},
                         {"RANK=" + std::to_string(r), "WORLD_SIZE=3", "MASTER_ADDR=127.0.0.1",
                          "MASTER_PORT=" + std::to_string(port)},
                         tmp_path(scenario + std::to_string(r))));
  std::vector<Run> runs;
  for (int r = 0; r < 3; ++r)
    runs.push_back(finish(pids[r], tmp_path(scenario + std::to_string(r))));
  CHECK(runs[1].status == 3);
  for (int r : {0, 2}) {
    CAPTURE(runs[r].out);
    CHECK(runs[r].status == 0);
    CHECK(runs[r].out.find("ERROR after") != std::string::npos);
    CHECK(runs[r].out.find("rank 1 died: its process ended") != std::string::npos);
    CHECK(runs[r].out.find("did not arrive") == std::string::npos);
    const long ms = std::stol(runs[r].out.substr(runs[r].out.find("after ") + 6));
    CHECK(ms < most_ms);
  }
}
}  // namespace

TEST_CASE("a rank that dies: the survivors fail within seconds, naming it") {
  const std::string prog = env_or_skip("RANK_PROGRAM");
  if (prog.empty()) return;
  // The group timeout is 10 s: the loss is seen, not waited out, and the
  // report does not wait for a post the dead rank cannot make (it took the
  // report's 2 s grace before the store posted for the dead).
  check_survivors_name_rank_1(prog, "die", 1000);
}

TEST_CASE("a rank that dies in a DataParallel step on sim: the survivors fail naming it") {
  // The device path: buckets on the sim device, the reduction on the
  // communication thread after the bucket's event. Nothing may hang there.
  const std::string prog = env_or_skip("RANK_PROGRAM");
  if (prog.empty()) return;
  check_survivors_name_rank_1(prog, "die_in_step", 10000);  // within the group's timeout
}

TEST_CASE("a rank that dies between sharded gathers on sim: the survivors fail naming it") {
  // The gathers run on ShardedUnits' communication thread; its failure
  // reaches the forward that waits for it.
  const std::string prog = env_or_skip("RANK_PROGRAM");
  if (prog.empty()) return;
  check_survivors_name_rank_1(prog, "die_in_gather", 10000);  // within the group's timeout
  for (int r : {0, 2}) {
    std::ifstream in(tmp_path("die_in_gather" + std::to_string(r)));
    const std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    CHECK(out.find("[ShardedUnits] gathering unit '") != std::string::npos);
  }
}

TEST_CASE("a lone rank says what it waits for, and QUANTA_DIST_TIMEOUT bounds the wait") {
  const std::string prog = env_or_skip("RANK_PROGRAM");
  if (prog.empty()) return;
  // Rank 0 of 2 whose rank 1 never starts, and rank 1 of 2 whose rank 0
  // (the store) never starts. rank_program asks for 10 s; the variable wins.
  const int port0 = free_port(), port1 = free_port();
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t p0 = spawn({prog, "ok"},
                         {"RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1",
                          "MASTER_PORT=" + std::to_string(port0), "QUANTA_DIST_TIMEOUT=4"},
                         tmp_path("lone0"));
  const pid_t p1 = spawn({prog, "ok"},
                         {"RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1",
                          "MASTER_PORT=" + std::to_string(port1), "QUANTA_DIST_TIMEOUT=4"},
                         tmp_path("lone1"));
  const Run r0 = finish(p0, tmp_path("lone0"));
  const Run r1 = finish(p1, tmp_path("lone1"));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(9));
  CAPTURE(r0.out);
  CAPTURE(r1.out);
  CHECK(r0.status == 1);
  CHECK(r1.status == 1);
  const std::string where0 = "tcp://127.0.0.1:" + std::to_string(port0);
  CHECK(r0.out.find("rank 0 of 2: waiting at " + where0 + " (group 'world') for rank 1 to join") !=
        std::string::npos);
  CHECK(r0.out.find("timed out after 4000 ms waiting at " + where0) != std::string::npos);
  const std::string where1 = "tcp://127.0.0.1:" + std::to_string(port1);
  CHECK(r1.out.find("[TcpStore] waiting for the store server at " + where1) != std::string::npos);
  CHECK(r1.out.find("could not connect to " + where1 + " within 4000 ms") != std::string::npos);
}

TEST_CASE("two processes started with the same RANK: every rank that meets them fails, naming it") {
  const std::string prog = env_or_skip("RANK_PROGRAM");
  if (prog.empty()) return;
  // World of 3, rank 2 never starts: rank 0 and both rank 1s meet at the
  // rendezvous, where Gloo's connect used to hang past its timeout.
  const int port = free_port();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<pid_t> pids;
  for (int i = 0; i < 3; ++i)
    pids.push_back(
        spawn({prog, "ok"},
              {"RANK=" + std::to_string(i == 0 ? 0 : 1), "WORLD_SIZE=3", "MASTER_ADDR=127.0.0.1",
               "MASTER_PORT=" + std::to_string(port), "QUANTA_DIST_TIMEOUT=20"},
              tmp_path("twice" + std::to_string(i))));
  for (int i = 0; i < 3; ++i) {
    const Run r = finish(pids[i], tmp_path("twice" + std::to_string(i)));
    CAPTURE(r.out);
    CHECK(r.status == 1);
    CHECK(r.out.find("rank 1 was started twice") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(12));
}

TEST_CASE("quanta launch: torchrun's environment, rank-prefixed output, exit status") {
  const std::string prog = env_or_skip("RANK_PROGRAM");
  const std::string quanta = env_or_skip("QUANTA_EXE");
  if (prog.empty() || quanta.empty()) return;
  SUBCASE("all ranks succeed") {
    Run r =
        finish(spawn({quanta, "launch", "-n", "2", "--", prog, "ok"}, {}, tmp_path("launch_ok")),
               tmp_path("launch_ok"));
    CAPTURE(r.out);
    CHECK(r.status == 0);
    CHECK(r.out.find("[rank 0] rank 0 of 2: sum 3") != std::string::npos);
    CHECK(r.out.find("[rank 1] rank 1 of 2: sum 3") != std::string::npos);
  }
  SUBCASE("one rank fails: the others are stopped, the exit status is the failing rank's") {
    const auto t0 = std::chrono::steady_clock::now();
    Run r = finish(
        spawn({quanta, "launch", "-n", "3", "--", prog, "fail"}, {}, tmp_path("launch_fail")),
        tmp_path("launch_fail"));
    CAPTURE(r.out);
    CHECK(r.status == 7);
    CHECK(r.out.find("[rank 1] rank 1 fails on purpose") != std::string::npos);
    CHECK(r.out.find("rank 1 exited with status 7") != std::string::npos);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));  // not the 60 s sleep
  }
  SUBCASE("a signal to the launcher stops every rank") {
    const auto t0 = std::chrono::steady_clock::now();
    const pid_t pid =
        spawn({quanta, "launch", "-n", "2", "--", "sleep", "30"}, {}, tmp_path("launch_sig"));
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    ::kill(pid, SIGTERM);
    Run r = finish(pid, tmp_path("launch_sig"));
    CAPTURE(r.out);
    CHECK(r.status == 128 + SIGTERM);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(15));
  }
  SUBCASE("every rank gets the job's random token; each job its own") {
    auto token_of = [&](const std::string& name, const std::vector<std::string>& env) {
      Run r = finish(spawn({quanta, "launch", "-n", "2", "--", "env"}, env, tmp_path(name)),
                     tmp_path(name));
      CAPTURE(r.out);
      CHECK(r.status == 0);
      const std::string key = "[rank 0] QUANTA_JOB_TOKEN=";
      const auto at = r.out.find(key);
      REQUIRE(at != std::string::npos);
      const std::string token =
          r.out.substr(at + key.size(), r.out.find('\n', at) - at - key.size());
      CHECK(r.out.find("[rank 1] QUANTA_JOB_TOKEN=" + token + "\n") != std::string::npos);
      return token;
    };
    const std::string a = token_of("launch_token_a", {}), b = token_of("launch_token_b", {});
    CHECK(a.size() == 32);
    CHECK(a != b);
    CHECK(token_of("launch_token_c", {"QUANTA_JOB_TOKEN=given"}) == "given");
  }
  SUBCASE("a program that does not exist") {
    Run r = finish(spawn({quanta, "launch", "-n", "2", "--", "/nonexistent/prog"}, {},
                         tmp_path("launch_missing")),
                   tmp_path("launch_missing"));
    CHECK(r.status != 0);
  }
}

TEST_CASE("launch_info_from_env: torchrun, Slurm, Open MPI, none, malformed") {
  const char* vars[] = {"RANK",
                        "WORLD_SIZE",
                        "LOCAL_RANK",
                        "MASTER_ADDR",
                        "MASTER_PORT",
                        "SLURM_PROCID",
                        "SLURM_NTASKS",
                        "SLURM_LOCALID",
                        "SLURM_JOB_ID",
                        "SLURM_LAUNCH_NODE_IPADDR",
                        "OMPI_COMM_WORLD_RANK",
                        "OMPI_COMM_WORLD_SIZE",
                        "OMPI_COMM_WORLD_LOCAL_RANK",
                        "QUANTA_JOB_TOKEN",
                        "QUANTA_STORE_BIND_ALL",
                        "QUANTA_DIST_TIMEOUT"};
  for (const char* v : vars) ::unsetenv(v);
  LaunchInfo none = launch_info_from_env();
  CHECK(none.source == "none");
  CHECK(none.world_size == 1);

  ::setenv("SLURM_PROCID", "3", 1);
  ::setenv("SLURM_NTASKS", "4", 1);
  ::setenv("SLURM_LOCALID", "1", 1);
  ::setenv("SLURM_JOB_ID", "12345", 1);
  LaunchInfo slurm = launch_info_from_env();
  CHECK(slurm.source == "slurm");
  CHECK(slurm.rank == 3);
  CHECK(slurm.world_size == 4);
  CHECK(slurm.local_rank == 1);
  CHECK(slurm.master_port == 29500 + 345);
  for (const char* v : vars) ::unsetenv(v);

  ::setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  ::setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  ::setenv("MASTER_ADDR", "10.0.0.5", 1);
  LaunchInfo mpi = launch_info_from_env();
  CHECK(mpi.source == "openmpi");
  CHECK(mpi.rank == 1);
  CHECK(mpi.master_addr == "10.0.0.5");
  for (const char* v : vars) ::unsetenv(v);

  ::setenv("RANK", "2", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  CHECK_THROWS_WITH_AS(launch_info_from_env(), doctest::Contains("rank 2 is outside a world of 2"),
                       std::invalid_argument);
  ::setenv("RANK", "x", 1);
  CHECK_THROWS_WITH_AS(launch_info_from_env(), doctest::Contains("RANK='x' is not an integer"),
                       std::invalid_argument);
  for (const char* v : vars) ::unsetenv(v);

  // quanta's own variables, whatever the launcher.
  CHECK(launch_info_from_env().timeout == Millis(0));
  CHECK(!launch_info_from_env().store_bind_all);
  ::setenv("QUANTA_DIST_TIMEOUT", "2.5", 1);
  ::setenv("QUANTA_STORE_BIND_ALL", "1", 1);
  ::setenv("QUANTA_JOB_TOKEN", "secret", 1);
  LaunchInfo mine = launch_info_from_env();
  CHECK(mine.timeout == Millis(2500));
  CHECK(mine.store_bind_all);
  CHECK(mine.job_token == "secret");
  for (const char* bad : {"abc", "0", "-3", "10s", "nan", "inf", "1e15"}) {
    ::setenv("QUANTA_DIST_TIMEOUT", bad, 1);
    const std::string want = "QUANTA_DIST_TIMEOUT='" + std::string(bad) +
                             "' is not a timeout: expected a number of seconds from 0.001 to 1e9";
    CHECK_THROWS_WITH_AS(launch_info_from_env(), doctest::Contains(want.c_str()),
                         std::invalid_argument);
  }
  ::unsetenv("QUANTA_DIST_TIMEOUT");
  ::setenv("QUANTA_STORE_BIND_ALL", "maybe", 1);
  CHECK_THROWS_WITH_AS(launch_info_from_env(),
                       doctest::Contains("QUANTA_STORE_BIND_ALL='maybe' is not a flag"),
                       std::invalid_argument);
  for (const char* v : vars) ::unsetenv(v);
  CHECK(init()->size() == 1);  // no launcher: a world of one
}
