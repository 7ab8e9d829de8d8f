#include "relaunch.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "dist/env.h"

namespace quanta::cli {
namespace {

// argv of this process, as the kernel holds it (NUL-separated).
std::vector<std::string> own_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  std::string cur;
  for (char c : raw) {
    if (c == '\0') {
      args.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) args.push_back(cur);
  if (args.empty()) throw std::runtime_error("--nproc: cannot read this process's command line");
  return args;
}

std::string own_executable() {
  std::vector<char> buf(4096);
  const ssize_t n = readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) throw std::runtime_error("--nproc: cannot find the quanta executable");
  return std::string(buf.data(), static_cast<size_t>(n));
}

}  // namespace

bool under_launcher() { return dist::launch_info_from_env().source != "none"; }

bool is_rank_zero() { return dist::launch_info_from_env().rank == 0; }

void relaunch_with_ranks(int nproc) {
  const std::string exe = own_executable();
  std::vector<std::string> args = {exe, "launch", "-n", std::to_string(nproc), "--", exe};
  const std::vector<std::string> own = own_command_line();
  args.insert(args.end(), own.begin() + 1, own.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  execv(exe.c_str(), argv.data());
  throw std::runtime_error("--nproc: cannot start quanta launch: " +
                           std::string(std::strerror(errno)));
}

}  // namespace quanta::cli
