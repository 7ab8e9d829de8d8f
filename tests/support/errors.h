#pragma once
// What a call throws, for tests that check error messages.
#include <exception>
#include <functional>
#include <string>

namespace quanta::testing {

/** The message of what `f` throws ("" when it does not throw). */
inline std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace quanta::testing
