#pragma once
// Where a tensor's bytes live: the CPU or one CUDA device.
#include <cstdint>
#include <string>

namespace quanta {

enum class DeviceType : uint8_t { cpu, cuda };

/** A device: cpu, or cuda with an ordinal. */
struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  static Device cpu() { return {DeviceType::cpu, 0}; }
  static Device cuda(int i = 0) { return {DeviceType::cuda, i}; }
  /** Parses "cpu", "cuda", "cuda:1"; throws std::invalid_argument. */
  static Device parse(const std::string& s);

  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  /** "cpu" or "cuda:N". */
  std::string str() const;
  bool operator==(const Device&) const = default;
};

/** True when quanta was compiled with its CUDA backend. */
bool cuda_built();
/** Number of visible CUDA devices (0 without CUDA or without a GPU). */
int cuda_device_count();

}  // namespace quanta
