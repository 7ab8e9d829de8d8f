// `quanta launch` as torchrun users run it: --max-restarts starts every rank
// again after a failure (and quanta train continues its run from --out), and
// --nnodes / --node-rank / --master-addr / --master-port run one job from
// several launchers, here two "nodes" on loopback. Every process is real;
// every test ends by itself within seconds. RANK_PROGRAM is
// tests/dist/rank_program.cpp (a 2- or 4-rank all_reduce).
#include <doctest/doctest.h>
#include <signal.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <ostream>
#include <thread>

#include "cli_runner.h"
#include "dist/store/store.h"
#include "train/outputs.h"
#include "train/run_folder.h"
#include "two_nodes.h"

using namespace quanta;
using namespace quanta::test;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string rank_program() {
  const char* p = std::getenv("RANK_PROGRAM");
  REQUIRE_MESSAGE(p != nullptr, "set RANK_PROGRAM to tests/dist/rank_program (meson test does)");
  return p;
}

std::string quanta_exe() {
  const char* exe = std::getenv("QUANTA_EXE");
  REQUIRE_MESSAGE(exe != nullptr, "set QUANTA_EXE to the quanta binary (meson test does)");
  return exe;
}

// `/bin/sh -c script args...`: $0, $1, ... in the script are `args`.
std::vector<std::string> shell(const std::string& script,
                               const std::vector<std::string>& args = {}) {
  std::vector<std::string> command = {"/bin/sh", "-c", script};
  command.insert(command.end(), args.begin(), args.end());
  return command;
}

// `quanta launch -n nproc [--max-restarts N] -- program...` on one node.
std::vector<std::string> launch_args(int nproc, std::optional<int> max_restarts,
                                     const std::vector<std::string>& program) {
  std::vector<std::string> args = {"launch", "-n", std::to_string(nproc)};
  if (max_restarts) args.insert(args.end(), {"--max-restarts", std::to_string(*max_restarts)});
  args.push_back("--");
  args.insert(args.end(), program.begin(), program.end());
  return args;
}

// Prints the attempt as the rank sees it; in attempt 0, rank 1 fails with
// status 7 (or, with `kill`, SIGKILLs itself) while rank 0 waits to be stopped.
std::vector<std::string> fails_once(const std::string& how = "exit 7") {
  return shell(
      "echo \"attempt $QUANTA_RESTART_COUNT of $QUANTA_MAX_RESTARTS torchelastic "
      "$TORCHELASTIC_RESTART_COUNT\"; if [ \"$QUANTA_RESTART_COUNT\" = 0 ]; then "
      "if [ \"$RANK\" = 1 ]; then " +
      how + "; fi; exec sleep 30; fi");
}

}  // namespace

TEST_CASE("quanta launch --max-restarts: a failed rank restarts every rank, each attempt counted") {
  const auto t0 = Clock::now();
  const CliResult r = run_quanta(launch_args(2, 2, fails_once()));
  CAPTURE(r);
  CHECK(r.code == 0);
  CHECK(contains(r.err, "[launch] rank 1 exited with status 7; stopping the other ranks"));
  CHECK(contains(r.err,
                 "[launch] restart 1 of 2: rank 1 exited with status 7 in attempt 1; starting "
                 "every rank again\n"));
  CHECK_FALSE(contains(r.err, "restart 2"));
  // (Rank 0 may be stopped in attempt 0 before it prints.)
  CHECK(contains(r.out, "[rank 1] attempt 0 of 2 torchelastic 0\n"));
  CHECK(contains(r.out, "[rank 0] attempt 1 of 2 torchelastic 1\n"));
  CHECK(contains(r.out, "[rank 1] attempt 1 of 2 torchelastic 1\n"));
  CHECK(seconds_since(t0) < 20);  // rank 0's sleep was stopped, not waited out
}

TEST_CASE("quanta launch without --max-restarts: one attempt, the failing rank's status") {
  const CliResult r = run_quanta(launch_args(2, std::nullopt, fails_once()));
  CAPTURE(r);
  CHECK(r.code == 7);
  CHECK(contains(r.err, "[launch] rank 1 exited with status 7; stopping the other ranks"));
  CHECK_FALSE(contains(r.err, "restart"));
  CHECK_FALSE(contains(r.out, "attempt 1"));
}

TEST_CASE("quanta launch --max-restarts: a rank that keeps dying ends the job after N restarts") {
  const CliResult r = run_quanta(
      launch_args(2, 1, shell("if [ \"$RANK\" = 1 ]; then kill -9 $$; fi; exec sleep 30")));
  CAPTURE(r);
  CHECK(r.code == 128 + SIGKILL);
  CHECK(contains(r.err, "[launch] restart 1 of 1: rank 1 was killed by signal 9 ("));
  CHECK(contains(r.err, ") in attempt 2 of 2; no restarts left (--max-restarts 1)"));
}

TEST_CASE("quanta launch --max-restarts: SIGTERM to the launcher stops the job, no restart") {
  CliProcess p(launch_args(2, 3, shell("echo ready; exec sleep 30")));
  const auto t0 = Clock::now();
  while (!contains(slurp(p.dir.file("out")), "[rank 1] ready") && seconds_since(t0) < 30)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  REQUIRE(::kill(p.pid, SIGTERM) == 0);
  const CliResult r = p.wait();
  CAPTURE(r.err);
  CHECK(r.code == 128 + SIGTERM);
  CHECK(contains(r.err, "[launch] got signal 15; stopping the ranks"));
  CHECK_FALSE(contains(r.err, "restart"));
}

TEST_CASE("quanta launch --nnodes 2: two launchers on loopback run one 4-rank job") {
  // Each rank shows where it is, then joins the job's all_reduce.
  const std::vector<std::string> program = shell(
      "echo \"rank $RANK local $LOCAL_RANK node $GROUP_RANK world $WORLD_SIZE local world "
      "$LOCAL_WORLD_SIZE\"; exec \"$0\" ok",
      {rank_program()});
  const auto t0 = Clock::now();
  // Node 1 first: it waits for node 0's rendezvous.
  const TwoNodeJob job = launch_two_nodes(program, {2, 2}, 0, /*first=*/1);
  const CliResult &r0 = job.r0, &r1 = job.r1;
  CAPTURE(job);
  CHECK(r0.code == 0);
  CHECK(r1.code == 0);
  CHECK(contains(r0.out, "[rank 0] rank 0 local 0 node 0 world 4 local world 2\n"));
  CHECK(contains(r0.out, "[rank 1] rank 1 local 1 node 0 world 4 local world 2\n"));
  CHECK(contains(r1.out, "[rank 2] rank 2 local 0 node 1 world 4 local world 2\n"));
  CHECK(contains(r1.out, "[rank 3] rank 3 local 1 node 1 world 4 local world 2\n"));
  for (int rank = 0; rank < 4; ++rank) {
    const std::string line = "[rank " + std::to_string(rank) + "] rank " + std::to_string(rank) +
                             " of 4: sum 10\n";  // 1 + 2 + 3 + 4
    CHECK(contains(rank < 2 ? r0.out : r1.out, line));
  }
  CHECK(seconds_since(t0) < 30);
}

namespace {

// Two nodes of one rank each; rank 1 (node 1) fails in attempt 0.
void one_node_fails(int max_restarts) {
  // Rank 0 is in the rendezvous when rank 1 fails.
  const std::vector<std::string> program = shell(
      "if [ \"$QUANTA_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then exit 7; fi; exec \"$0\" ok",
      {rank_program()});
  const auto t0 = Clock::now();
  const TwoNodeJob job = launch_two_nodes(program, {1, 1}, max_restarts, /*first=*/0);
  const CliResult &r0 = job.r0, &r1 = job.r1;
  CAPTURE(job);
  CHECK(contains(r1.err, "[launch node 1] rank 1 exited with status 7; stopping the other ranks"));
  CHECK(contains(r0.err,
                 "[launch node 0] rank 1 exited with status 7 on node 1; stopping the ranks of "
                 "this node"));
  if (max_restarts == 1) {
    CHECK(r0.code == 0);
    CHECK(r1.code == 0);
    for (const CliResult* r : {&r0, &r1})
      CHECK(contains(r->err,
                     "restart 1 of 1: rank 1 exited with status 7 on node 1 in attempt 1; "
                     "starting every rank again"));
    CHECK(contains(r0.out, "[rank 0] rank 0 of 2: sum 3\n"));
    CHECK(contains(r1.out, "[rank 1] rank 1 of 2: sum 3\n"));
  } else {
    // Every node ends with the failing rank's status.
    CHECK(r0.code == 7);
    CHECK(r1.code == 7);
    CHECK_FALSE(contains(r0.err + r1.err, "restart"));
  }
  CHECK(seconds_since(t0) < 40);
}

}  // namespace

TEST_CASE("quanta launch --nnodes 2: a failure on one node restarts (or ends) both") {
  for (const int max_restarts : {1, 0}) {
    CAPTURE(max_restarts);
    one_node_fails(max_restarts);
  }
}

TEST_CASE("quanta launch --nnodes 2: a node started unlike node 0 stops the whole job") {
  const auto t0 = Clock::now();
  // Node 1 asks for 2 ranks per node, node 0 for 1.
  const TwoNodeJob job = launch_two_nodes(shell("exec sleep 30"), {1, 2}, 0, /*first=*/0);
  const CliResult &r0 = job.r0, &r1 = job.r1;
  CAPTURE(job);
  const std::string why =
      "node 1 was started with --nnodes 2 --nproc-per-node 2 --max-restarts 0 but node 0 with "
      "--nnodes 2 --nproc-per-node 1 --max-restarts 0: start every node with the same";
  CHECK(r1.code == 1);
  CHECK(contains(r1.err, why));
  CHECK(r0.code == 1);
  CHECK(contains(r0.err, why));
  CHECK(seconds_since(t0) < 20);  // node 0's sleeping rank was stopped
}

TEST_CASE("quanta train restarted by quanta launch continues its run from --out") {
  if (!have_dataset()) return;
  ScratchDir dir("launch_train_restart");
  const std::string out = dir.file("run");
  // Attempt 0 trains 4 steps (a checkpoint at step 4) and then rank 0 fails;
  // attempt 1 finds the run complete and rank 0 fails again; attempt 2 asks
  // for 8 steps and must continue from step 4. (Changing --steps per attempt
  // is the test's way to fail after a known checkpoint; rank 0 fails, as it
  // prints what the test reads and would be stopped by another's failure.)
  const std::string script =
      "steps=4; [ \"$QUANTA_RESTART_COUNT\" = 2 ] && steps=8; "
      "\"$0\" train --steps $steps --limit-train 128 --limit-test 16 --batch-size 16 "
      "--hidden 4 --dim 4 --eval-every 4 --threads 1 --out " +
      out +
      " || exit $?; "
      "if [ \"$QUANTA_RESTART_COUNT\" != 2 ] && [ \"$RANK\" = 0 ]; then exit 9; fi";
  const auto t0 = Clock::now();
  const CliResult r = run_quanta(launch_args(2, 2, shell(script, {quanta_exe()})));
  CAPTURE(r);
  CHECK(r.code == 0);
  CHECK(contains(r.err, "[launch] restart 1 of 2: rank 0 exited with status 9 in attempt 1"));
  CHECK(contains(r.err, "[launch] restart 2 of 2: rank 0 exited with status 9 in attempt 2"));
  CHECK(contains(r.out, "[rank 0] restart 1 of 2: the run in " + out +
                            " is complete (its checkpoint is at its last step, 4); nothing left "
                            "to train\n"));
  CHECK(contains(r.out, "[rank 0] restart 2 of 2: resuming the run in " + out +
                            " from its checkpoint (step 4)\n"));
  CHECK(contains(r.out, "[rank 0] resuming at step 4 of 8"));
  CHECK(contains(r.out, "[rank 0] done: 8 steps"));
  CHECK_FALSE(contains(r.out, "[rank 1] restart"));  // rank 0 speaks for the run
  // metrics.jsonl: the first start and the resumed one, the steps continuing.
  std::vector<int64_t> headers, train_steps;
  for (const auto& rec : train::read_metrics(out + "/metrics.jsonl")) {
    if (rec["kind"] == "header") headers.push_back(rec["step"].get<int64_t>());
    if (rec["kind"] == "train") train_steps.push_back(rec["step"].get<int64_t>());
  }
  CHECK(headers == std::vector<int64_t>{0, 4});
  REQUIRE_FALSE(train_steps.empty());
  CHECK(train_steps.back() == 8);
  CHECK(seconds_since(t0) < 120);
}

TEST_CASE("quanta finetune and train --task classify restarted: they continue from --out") {
  if (!have_dataset()) return;
  ScratchDir dir("launch_finetune_restart");
  const std::string clf = dir.file("clf"), lora = dir.file("lora");
  // Attempt 0: the classifier, then a failure; attempt 1: the classifier is
  // complete, the fine-tuning runs, then a failure; attempt 2: both complete.
  const std::string script =
      "\"$0\" train --task classify --steps 5 --limit-train 128 --limit-test 32 --out " + clf +
      " || exit $?; [ \"$QUANTA_RESTART_COUNT\" = 0 ] && exit 9; \"$0\" finetune " + clf +
      "/checkpoint.safetensors --out " + lora +
      " --steps 3 --limit-train 64 --limit-test 32 || exit $?; "
      "[ \"$QUANTA_RESTART_COUNT\" = 1 ] && exit 9; exit 0";
  const CliResult r = run_quanta(launch_args(1, 2, shell(script, {quanta_exe()})));
  CAPTURE(r);
  CHECK(r.code == 0);
  for (const char* restart : {"1 of 2", "2 of 2"})
    CHECK(contains(r.out, std::string("[rank 0] restart ") + restart + ": the run in " + clf +
                              " is complete (its checkpoint is at its last step, 5); nothing "
                              "left to train\n"));
  CHECK(contains(
      r.out,
      "[rank 0] restart 2 of 2: the run in " + lora +
          " is complete (its checkpoint is at its last step, 3); nothing left to fine-tune\n"));
  CHECK(fs::exists(lora + "/adapters.safetensors"));
}

TEST_CASE("quanta train under --max-restarts: another run in --out is refused in every attempt") {
  ScratchDir dir("launch_train_refuse");
  const std::string out = dir.file("run");
  // What an earlier job left: a run claimed by another launcher job.
  fs::create_directories(out);
  std::ofstream(out + "/checkpoint.safetensors") << "earlier run";
  std::ofstream(out + "/metrics.jsonl") << "{}\n";
  train::claim_run(out, "an-earlier-job");
  const std::string exe = quanta_exe();
  const CliResult r = run_quanta(launch_args(1, 1, {exe, "train", "--steps", "1", "--out", out}));
  CAPTURE(r);
  CHECK(r.code == 2);
  // Refused in attempt 1 and again in its restart: never resumed or replaced.
  const std::string refusal = "[rank 0] quanta: error: --out " + out + " already holds a run";
  const auto first = r.err.find(refusal);
  REQUIRE(first != std::string::npos);
  CHECK(r.err.find(refusal, first + 1) != std::string::npos);
  CHECK(slurp(out + "/checkpoint.safetensors") == "earlier run");
  // And the default folder, named after each start's time, cannot be found again.
  const CliResult no_out = run_quanta(launch_args(1, 1, {exe, "train", "--steps", "1"}));
  CHECK(no_out.code == 2);
  CHECK(contains(no_out.err,
                 "started with restarts (--max-restarts), this run must be in a "
                 "folder a restart can find: give --out DIR"));
}

TEST_CASE("restart_plan: only a restart of the job that claimed the folder continues it") {
  ScratchDir dir("restart_plan");
  const std::string out = dir.file("run");
  train::LaunchRestarts first{0, 2, "job-a"}, restart{1, 2, "job-a"}, other{1, 2, "job-b"};
  CHECK(train::restart_plan(out, restart, "ck") == train::RestartPlan::first_start);  // unclaimed
  train::claim_run(out, "job-a");
  CHECK(train::restart_plan(out, first, "ck") == train::RestartPlan::first_start);
  CHECK(train::restart_plan(out, other, "ck") == train::RestartPlan::first_start);
  CHECK(train::restart_plan(out, restart, "ck") == train::RestartPlan::start_again);
  std::ofstream(out + "/ck") << "x";
  CHECK(train::restart_plan(out, restart, "ck") == train::RestartPlan::resume);
  CHECK(train::restart_plan(out, restart, "") == train::RestartPlan::start_again);
  CHECK(train::restart_text(restart) == "restart 1 of 2");
  train::claim_run(out, "");  // no run id: nothing recorded
  CHECK(slurp(out + "/" + train::kRunIdFile) == "job-a\n");
}

TEST_CASE("launch_restarts_from_env: quanta launch's variables, else torchrun's") {
  const char* names[] = {
      "QUANTA_RESTART_COUNT",       "QUANTA_MAX_RESTARTS",       "QUANTA_RUN_ID",
      "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID"};
  for (const char* n : names) ::unsetenv(n);
  train::LaunchRestarts none = train::launch_restarts_from_env();
  CHECK(none.count == 0);
  CHECK(none.max == 0);
  CHECK(none.run_id.empty());
  ::setenv("TORCHELASTIC_RESTART_COUNT", "2", 1);
  ::setenv("TORCHELASTIC_MAX_RESTARTS", "3", 1);
  ::setenv("TORCHELASTIC_RUN_ID", "none", 1);  // torchrun's default: not an id
  train::LaunchRestarts torch = train::launch_restarts_from_env();
  CHECK(torch.count == 2);
  CHECK(torch.max == 3);
  CHECK(torch.run_id.empty());
  ::setenv("QUANTA_RESTART_COUNT", "1", 1);
  ::setenv("QUANTA_RUN_ID", "abc", 1);
  train::LaunchRestarts q = train::launch_restarts_from_env();
  CHECK(q.count == 1);
  CHECK(q.run_id == "abc");
  ::setenv("QUANTA_RESTART_COUNT", "-1", 1);
  CHECK_THROWS_WITH_AS(train::launch_restarts_from_env(),
                       doctest::Contains("QUANTA_RESTART_COUNT='-1' is not a restart count"),
                       std::invalid_argument);
  for (const char* n : names) ::unsetenv(n);
}
