#pragma once
// How the command's OpenMP threads wait. A thread that finishes its share of
// a parallel region early waits for the others; libgomp's default is to spin
// (up to 300,000 iterations) before sleeping. On a machine with other work
// on it (a data loader, a compile, another job) the spinning thread holds the
// core the late thread needs, and a training step of the main job took 3-4x
// its time. Sleeping at once (OMP_WAIT_POLICY=passive) cost 25% on an idle
// machine; a short spin of 1,000 iterations cost about 5% there and kept
// almost all of passive's gain under load (docs/performance.md, "Under load").
//
// libgomp reads its policy from the environment only when it is loaded, so
// the command sets GOMP_SPINCOUNT and starts itself again (execv of
// /proc/self/exe with the same arguments and pid), once, before anything else
// runs. A policy the user chose (OMP_WAIT_POLICY or GOMP_SPINCOUNT set) is
// kept as it is.

namespace quanta::cli {

/** The variable the command sets and the value it sets it to. */
inline constexpr const char* kWaitPolicyVar = "GOMP_SPINCOUNT";
inline constexpr const char* kWaitPolicy = "1000";

/** Restarts this process with GOMP_SPINCOUNT=1000 unless the environment
 * already names a wait policy; returns (doing nothing) when it does, or when
 * the restart cannot be made (the command then runs with the default). */
void adopt_wait_policy(char** argv);

/** The wait policy this process runs with, for the logs: the value of
 * OMP_WAIT_POLICY, "spincount N" for GOMP_SPINCOUNT, or "default". */
const char* wait_policy_name();

}  // namespace quanta::cli
