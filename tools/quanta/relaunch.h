#pragma once
// `--nproc N` for the training subcommands: a command started by hand with
// --nproc N > 1 replaces itself with `quanta launch -n N -- <the same
// command>`, so each of the N ranks runs it again under a launcher
// environment (dist::launch_info_from_env), exactly as torchrun, srun or
// mpirun would start it.

namespace quanta::cli {

/** True when a launcher started this process (torchrun / quanta launch,
 * Slurm or Open MPI variables are set). */
bool under_launcher();

/** True unless a launcher started this process as a rank other than 0 (the
 * rank that prints and writes). */
bool is_rank_zero();

/** Replaces this process with `quanta launch -n nproc -- <this process's own
 * command line>` (read from /proc/self/cmdline); throws std::runtime_error
 * when that cannot be done. */
[[noreturn]] void relaunch_with_ranks(int nproc);

}  // namespace quanta::cli
