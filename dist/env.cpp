#include "dist/env.h"

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

}  // namespace

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
  if (info.world_size == 1) return ProcessGroup::single(std::move(opts));
  auto store =
      std::make_shared<TcpStore>(info.master_addr, info.master_port, info.rank == 0, opts.timeout);
  return std::make_shared<ProcessGroup>(store, info.rank, info.world_size, std::move(opts));
}

}  // namespace quanta::dist
