// Precompiled for the quanta command's and the training pipeline's sources
// (tools/meson.build): CLI11, nlohmann-json and the library's headers are
// most of what each of those files parses.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "quanta.h"
