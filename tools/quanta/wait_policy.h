#pragma once
// How the command's OpenMP threads wait. A thread that finishes its share of
// a parallel region early waits for the others; libgomp's default is to spin
// (up to 300,000 iterations) before sleeping. On a machine with other work
// on it (a data loader, a compile, another job) the spinning thread holds the
// core the late thread needs, and a training step of the main job took 4-16x
// its time (docs/performance.md, "Under load"). Passive waiting sleeps at once.
//
// libgomp reads its policy from the environment only when it is loaded, so
// the command sets it and starts itself again (execv of /proc/self/exe with
// the same arguments and pid), once, before anything else runs. A policy the
// user chose (OMP_WAIT_POLICY or GOMP_SPINCOUNT set) is kept as it is.

namespace quanta::cli {

/** The variable the command sets and the value it sets it to. */
inline constexpr const char* kWaitPolicyVar = "OMP_WAIT_POLICY";
inline constexpr const char* kWaitPolicy = "passive";

/** Restarts this process with OMP_WAIT_POLICY=passive unless the environment
 * already names a wait policy; returns (doing nothing) when it does, or when
 * the restart cannot be made (the command then runs with the default). */
void adopt_wait_policy(char** argv);

/** The wait policy this process runs with, for the logs: the value of
 * OMP_WAIT_POLICY, "spincount N" for GOMP_SPINCOUNT, or "default". */
const char* wait_policy_name();

}  // namespace quanta::cli
