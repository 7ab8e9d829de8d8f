#pragma once
// Where a rank learns who it is: the environment that launchers set.
//   torchrun / quanta launch: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
//   Slurm (srun):             SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
//   Open MPI (mpirun):        OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE,
//                             OMPI_COMM_WORLD_LOCAL_RANK
// Under Slurm and Open MPI, MASTER_ADDR / MASTER_PORT still name the store
// when set; otherwise the store is on 127.0.0.1 (one node) at port 29500
// (Slurm: 29500 + SLURM_JOB_ID % 1000, so two jobs on a node do not clash).
// Whatever the launcher, quanta also reads:
//   QUANTA_JOB_TOKEN       the job's shared secret (quanta launch sets a random
//                          one); the store refuses connections without it
//   QUANTA_STORE_BIND_ALL  1: rank 0's store listens on every interface, not
//                          only on MASTER_ADDR
//   QUANTA_DIST_TIMEOUT    seconds: rendezvous and collective timeout
#include <memory>
#include <string>

#include "dist/process_group.h"

namespace quanta::dist {

/** A rank's place in the job. */
struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  /** "torchrun", "slurm", "openmpi" or "none" (no launcher: world of one). */
  std::string source = "none";
  /** QUANTA_JOB_TOKEN; empty: the fixed default token (TcpStoreOptions). */
  std::string job_token{};
  /** QUANTA_STORE_BIND_ALL=1 (or MASTER_ADDR=0.0.0.0): the store listens
   * on every interface. */
  bool store_bind_all = false;
  /** QUANTA_DIST_TIMEOUT in ms; 0 when unset (GroupOptions::timeout holds). */
  Millis timeout{0};
};

/** An environment flag: unset or empty is false, 1/true/yes true, 0/false/no
 * false; any other value throws std::invalid_argument naming the variable
 * (a typo must not quietly switch a check off). */
bool env_flag(const char* name);

/** Reads the launcher's environment (torchrun first, then Slurm, then Open
 * MPI); throws std::invalid_argument naming a malformed variable. */
LaunchInfo launch_info_from_env();

/** The group of this job: from the environment (see launch_info_from_env),
 * a TcpStore hosted by rank 0. With no launcher, a world of one.
 * QUANTA_DIST_TIMEOUT, when set, replaces opts.timeout. */
std::shared_ptr<ProcessGroup> init(GroupOptions opts = {});
/** The group with an explicit place: rank 0 hosts the TcpStore at
 * master_addr:master_port. */
std::shared_ptr<ProcessGroup> init(const LaunchInfo& info, GroupOptions opts = {});

}  // namespace quanta::dist
