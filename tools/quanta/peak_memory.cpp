#include "peak_memory.h"

#include <fstream>
#include <string>

namespace quanta::cli {

int64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return -1;
}

}  // namespace quanta::cli
