#include "engine/device.h"

#include <stdexcept>

namespace quanta {

Device Device::parse(const std::string& s) {
  if (s == "cpu") return cpu();
  if (s == "cuda") return cuda(0);
  if (s.rfind("cuda:", 0) == 0) {
    const std::string num = s.substr(5);
    if (!num.empty() && num.find_first_not_of("0123456789") == std::string::npos)
      return cuda(std::stoi(num));
  }
  throw std::invalid_argument("[Device] cannot parse device: got '" + s +
                              "', expected 'cpu', 'cuda' or 'cuda:N'");
}

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }

}  // namespace quanta
