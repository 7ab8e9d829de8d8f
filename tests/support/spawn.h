#pragma once
// Starting a program for a test: no shell, output to files.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/types.h>
#include <unistd.h>

#include <string>
#include <vector>

extern char** environ;

namespace quanta::testing {

/** Starts args[0] (a path) with `args`, this process's environment plus
 * `extra_env` ("NAME=value" entries, later ones win), stdout to `out_path`
 * and stderr to `err_path` (to `out_path` as well when empty). Fails the
 * test naming the program when it cannot start. The caller waits for it. */
inline pid_t spawn_process(const std::vector<std::string>& args,
                           const std::vector<std::string>& extra_env, const std::string& out_path,
                           const std::string& err_path = "") {
  REQUIRE_MESSAGE(!args.empty(), "spawn_process: no program");
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) env.push_back(*e);
  env.insert(env.end(), extra_env.begin(), extra_env.end());
  std::vector<std::string> a = args;
  std::vector<char*> argv, envp;
  for (auto& s : a) argv.push_back(s.data());
  argv.push_back(nullptr);
  for (auto& kv : env) envp.push_back(kv.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (err_path.empty())
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
  else
    posix_spawn_file_actions_addopen(&fa, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  REQUIRE_MESSAGE(rc == 0, "cannot run " << args[0]);
  return pid;
}

}  // namespace quanta::testing
