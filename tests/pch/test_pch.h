// Precompiled for every test source of the suites (tests/meson.build): at -O0
// a test file's compile is mostly parsing doctest and the library's headers,
// and parsing them once for all sources halves the suites' build.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "quanta.h"
