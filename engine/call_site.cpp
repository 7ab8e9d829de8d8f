// Call stacks through glibc's backtrace() and dladdr(): no debug info
// needed, names for every exported function (all of libquanta's), module
// and offset for the rest, which addr2line turns into a line.
#include "engine/call_site.h"

#include <cxxabi.h>
#include <dlfcn.h>
#include <execinfo.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>

namespace quanta::detail {

std::vector<void*> call_stack(int skip, int depth) {
  std::vector<void*> frames(static_cast<std::size_t>(depth + skip + 1));
  const int n = backtrace(frames.data(), static_cast<int>(frames.size()));
  const int first = std::min(n, skip + 1);
  return {frames.begin() + first, frames.begin() + n};
}

namespace {

std::string demangled(const char* name) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> out(abi::__cxa_demangle(name, nullptr, nullptr, &status),
                                             std::free);
  return status == 0 && out ? std::string(out.get()) : std::string(name);
}

std::string describe(void* frame) {
  Dl_info info{};
  // A return address points after the call; one byte back is inside it.
  void* pc = static_cast<char*>(frame) - 1;
  if (dladdr(pc, &info) == 0) return "??";
  if (info.dli_sname) return demangled(info.dli_sname);
  char offset[32];
  std::snprintf(
      offset, sizeof offset, "+0x%zx",
      static_cast<std::size_t>(static_cast<char*>(pc) - static_cast<char*>(info.dli_fbase)));
  return std::string(info.dli_fname ? info.dli_fname : "??") + offset;
}

// The copy machinery every host read passes through: naming it says nothing.
bool is_machinery(const std::string& name) {
  for (const char* prefix :
       {"quanta::detail::count_copy", "quanta::copy_bytes",
        "quanta::Storage::", "quanta::Tensor::to(", "quanta::Tensor::contiguous",
        "quanta::Tensor::to_vector", "quanta::Tensor::item", "quanta::Tensor::copy_"})
    if (name.rfind(prefix, 0) == 0) return true;
  return false;
}

}  // namespace

std::string describe_call_stack(const std::vector<void*>& frames, int lines) {
  std::string out;
  int written = 0;
  bool inside_machinery = true;
  for (void* frame : frames) {
    if (written == lines) break;
    const std::string name = describe(frame);
    if (inside_machinery && is_machinery(name)) continue;
    inside_machinery = false;
    out += "\n    at " + name;
    ++written;
  }
  return out;
}

}  // namespace quanta::detail
