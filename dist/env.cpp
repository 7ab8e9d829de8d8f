#include "dist/env.h"

#include <charconv>
#include <cstdlib>
#include <stdexcept>

namespace quanta::dist {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int env_int(const char* name, int fallback) {
  const char* v = env(name);
  if (!v) return fallback;
  try {
    std::size_t used = 0;
    const int x = std::stoi(v, &used);
    if (used == std::string(v).size()) return x;
  } catch (const std::exception&) {
  }
  throw std::invalid_argument(std::string("[dist::init] ") + name + "='" + v +
                              "' is not an integer");
}

// QUANTA_DIST_TIMEOUT: a positive number of seconds ("300", "2.5"); 0 ms when unset.
Millis env_timeout(const char* name) {
  const char* v = env(name);
  if (!v) return Millis(0);
  const std::string s = v;
  double seconds = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), seconds);
  if (ec != std::errc() || end != s.data() + s.size() || !(seconds >= 0.001) || seconds > 1e9)
    throw std::invalid_argument(std::string("[dist::init] ") + name + "='" + s +
                                "' is not a timeout: expected a number of seconds from 0.001 to "
                                "1e9 (about 31 years), e.g. 300 or 2.5");
  return Millis(static_cast<int64_t>(seconds * 1000 + 0.5));
}

}  // namespace

bool env_flag(const char* name) {
  const char* v = env(name);
  if (!v) return false;
  const std::string s = v;
  if (s == "1" || s == "true" || s == "yes") return true;
  if (s == "0" || s == "false" || s == "no") return false;
  throw std::invalid_argument(std::string("[dist] ") + name + "='" + s +
                              "' is not a flag: expected 1 or 0 (true/false, yes/no)");
}

LaunchInfo launch_info_from_env() {
  LaunchInfo info;
  if (env("RANK") || env("WORLD_SIZE")) {
    info.source = "torchrun";
    info.rank = env_int("RANK", 0);
    info.world_size = env_int("WORLD_SIZE", 1);
    info.local_rank = env_int("LOCAL_RANK", 0);
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    info.source = "slurm";
    info.rank = env_int("SLURM_PROCID", 0);
    info.world_size = env_int("SLURM_NTASKS", 1);
    info.local_rank = env_int("SLURM_LOCALID", 0);
    info.master_port = 29500 + env_int("SLURM_JOB_ID", 0) % 1000;
    if (const char* a = env("SLURM_LAUNCH_NODE_IPADDR")) info.master_addr = a;
  } else if (env("OMPI_COMM_WORLD_RANK")) {
    info.source = "openmpi";
    info.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    info.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1);
    info.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
  }
  if (const char* a = env("MASTER_ADDR")) info.master_addr = a;
  info.master_port = env_int("MASTER_PORT", info.master_port);
  if (const char* t = env("QUANTA_JOB_TOKEN")) info.job_token = t;
  info.store_bind_all = env_flag("QUANTA_STORE_BIND_ALL") || info.master_addr == "0.0.0.0";
  info.timeout = env_timeout("QUANTA_DIST_TIMEOUT");
  if (info.world_size < 1 || info.rank < 0 || info.rank >= info.world_size)
    throw std::invalid_argument("[dist::init] rank " + std::to_string(info.rank) +
                                " is outside a world of " + std::to_string(info.world_size) +
                                " (from " + info.source + " variables)");
  if (info.master_port <= 0 || info.master_port > 65535)
    throw std::invalid_argument("[dist::init] MASTER_PORT " + std::to_string(info.master_port) +
                                " is not a port");
  return info;
}

std::shared_ptr<ProcessGroup> init(GroupOptions opts) {
  return init(launch_info_from_env(), std::move(opts));
}

std::shared_ptr<ProcessGroup> init(const LaunchInfo& info, GroupOptions opts) {
  if (info.timeout > Millis(0)) opts.timeout = info.timeout;
  if (info.world_size == 1) return ProcessGroup::single(std::move(opts));
  TcpStoreOptions store_opts;
  if (!info.job_token.empty()) store_opts.token = info.job_token;
  if (info.store_bind_all) store_opts.bind = "0.0.0.0";
  auto store = std::make_shared<TcpStore>(info.master_addr, info.master_port, info.rank == 0,
                                          opts.timeout, store_opts);
  return std::make_shared<ProcessGroup>(store, info.rank, info.world_size, std::move(opts));
}

}  // namespace quanta::dist
