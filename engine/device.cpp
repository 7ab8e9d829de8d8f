#include "engine/device.h"

#include <stdexcept>
#include <utility>

namespace quanta {

Device Device::parse(const std::string& s) {
  if (s == "cpu") return cpu();
  for (const auto& [name, type] : {std::pair{std::string("cuda"), DeviceType::cuda},
                                   std::pair{std::string("sim"), DeviceType::sim}}) {
    if (s == name) return {type, 0};
    if (s.rfind(name + ":", 0) == 0) {
      const std::string num = s.substr(name.size() + 1);
      if (!num.empty() && num.size() <= 4 &&
          num.find_first_not_of("0123456789") == std::string::npos)
        return {type, std::stoi(num)};
    }
  }
  throw std::invalid_argument("[Device] cannot parse device: got '" + s +
                              "', expected 'cpu', 'cuda', 'cuda:N', 'sim' or 'sim:N'");
}

std::string Device::str() const {
  switch (type) {
    case DeviceType::cpu:
      return "cpu";
    case DeviceType::cuda:
      return "cuda:" + std::to_string(index);
    case DeviceType::sim:
      return "sim:" + std::to_string(index);
  }
  return "?";
}

}  // namespace quanta
