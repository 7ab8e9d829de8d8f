// The CUDA module (engine/cuda/module.h): libquanta links no CUDA library and
// loads libquanta_cuda on demand, so it loads on machines without CUDA; a
// module that is missing or foreign is refused with a reason.
#include <dlfcn.h>
#include <doctest/doctest.h>

#include <cstdio>
#include <memory>
#include <string>

#include "engine/cuda/module.h"
#include "engine/cuda/runtime.h"
#include "engine/kernels/table.h"
#include "quanta.h"

using namespace quanta;

namespace {

// The file libquanta was loaded from (the object defining cuda_device_count).
std::string libquanta_path() {
  Dl_info info{};
  REQUIRE(dladdr(reinterpret_cast<void*>(&cuda_device_count), &info) != 0);
  REQUIRE(info.dli_fname != nullptr);
  return info.dli_fname;
}

// `readelf -d`'s NEEDED lines of `path`.
std::string needed_libraries(const std::string& path) {
  const std::string cmd = "readelf -d '" + path + "' 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out, line;
  char buf[512];
  while (fgets(buf, sizeof buf, p)) {
    line = buf;
    if (line.find("(NEEDED)") != std::string::npos) out += line;
  }
  const int rc = pclose(p);
  INFO("readelf -d " << path << " exit status " << rc);
  REQUIRE(rc == 0);
  return out;
}

}  // namespace

TEST_CASE("cuda module: libquanta needs no CUDA library, whether or not CUDA was built") {
  const std::string lib = libquanta_path();
  const std::string needed = needed_libraries(lib);
  INFO(lib << " NEEDED:\n" << needed);
  CHECK(needed.find("libquanta") == std::string::npos);  // not the module either
  for (const char* cuda_lib : {"libcudart", "libcublas", "libnccl", "libcuda."})
    CHECK_MESSAGE(needed.find(cuda_lib) == std::string::npos, cuda_lib);
  CHECK(needed.find("libc.so") != std::string::npos);  // the parse saw the list
}

TEST_CASE("cuda module: loaded when built, or a reason that names the missing piece") {
  if (!cuda_built()) {
    CHECK(cuda::module() == nullptr);
    CHECK(cuda::unavailable_reason().find("quanta was built without CUDA") == 0);
    CHECK(cuda_device_count() == 0);
    CHECK_THROWS_WITH_AS(cuda::synchronize(0),
                         doctest::Contains("[cuda::synchronize] quanta was built without CUDA"),
                         std::runtime_error);
    CHECK_THROWS_WITH_AS(cuda::record_event(0),
                         doctest::Contains("[cuda::record_event] quanta was built without CUDA"),
                         std::runtime_error);
    CHECK_THROWS_WITH_AS(cuda::module_symbol("dist::nccl", "quanta_nccl_backend_v1"),
                         doctest::Contains("[dist::nccl] quanta was built without CUDA"),
                         std::runtime_error);
    return;
  }
  // Built with CUDA: the build puts the module beside libquanta, and the CUDA
  // libraries it links are on this machine (a GPU is not needed to load).
  INFO(cuda::unavailable_reason());
  REQUIRE(cuda::module() != nullptr);
  CHECK(cuda::unavailable_reason().empty());
  CHECK(cuda::module()->abi == cuda::Module::kAbi);
  const bool has_synchronize = cuda::module()->synchronize != nullptr;
  CHECK(has_synchronize);
  const bool has_events =
      cuda::module()->record_event != nullptr && cuda::module()->release_event != nullptr;
  CHECK(has_events);
  if (cuda_device_count() > 0) {
    std::shared_ptr<void> e = cuda::record_event(0);  // released with the last copy
    CHECK(e != nullptr);
  } else {
    CHECK_THROWS(cuda::record_event(0));  // no device to record on
  }
  CHECK(std::string(cuda::module()->kernels().device_name) == "cuda");
  CHECK(cuda::module_symbol("dist::nccl", "quanta_nccl_backend_v1") != nullptr);
  CHECK_THROWS_WITH_AS(cuda::module_symbol("test", "no_such_symbol"),
                       doctest::Contains("[test] the CUDA backend has no no_such_symbol"),
                       std::runtime_error);
}

TEST_CASE("cuda module: a missing file or a library that is not the module is refused") {
  const std::string missing = cuda::try_load("/nonexistent/libquanta_cuda.so");
  CHECK(missing.find("the CUDA backend could not be loaded") == 0);
  CHECK(missing.find("/nonexistent/libquanta_cuda.so") != std::string::npos);
  // A real shared library without quanta's entry point.
  const std::string foreign = cuda::try_load("libm.so.6");
  CHECK(foreign.find("the CUDA backend libm.so.6 is not this quanta's (no entry point") == 0);
}
