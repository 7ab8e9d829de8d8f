#pragma once
// The device a run's --device names (train, both tasks, and finetune), with
// one clear error when this build or this machine cannot give it.
#include <string>

#include "engine/device.h"

namespace quanta::train {

/** "cpu", "cuda", "cuda:N", "sim" or "sim:N" as a Device. Throws
 * std::invalid_argument naming --device and the value when it is none of
 * those, when this quanta was built without CUDA, or when cuda:N is not
 * visible. */
Device run_device(const std::string& value);

}  // namespace quanta::train
