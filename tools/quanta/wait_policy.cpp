#include "wait_policy.h"

#include <unistd.h>

#include <cstdlib>
#include <string>

namespace quanta::cli {

void adopt_wait_policy(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT")) return;
  if (setenv(kWaitPolicyVar, kWaitPolicy, 1) != 0) return;
  // Same pid, arguments and environment (plus the policy): a launcher that
  // watches this pid, or a shell waiting on it, sees nothing happen.
  execv("/proc/self/exe", argv);
  unsetenv(kWaitPolicyVar);  // no restart: say so truthfully in the logs
}

const char* wait_policy_name() {
  static const std::string name = [] {
    if (const char* p = std::getenv("OMP_WAIT_POLICY")) return std::string(p);
    if (const char* s = std::getenv("GOMP_SPINCOUNT")) return "spincount " + std::string(s);
    return std::string("default");
  }();
  return name.c_str();
}

}  // namespace quanta::cli
