#pragma once
// A fresh folder per test under the system temp dir, removed at the end.
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>

namespace quanta::testing {

class TempDir {
 public:
  /** `tag` names the suite in the folder name (quanta_<tag>_<pid>_<n>). */
  explicit TempDir(const std::string& tag = "test") {
    static std::atomic<int> n{0};
    path_ = std::filesystem::temp_directory_path() /
            ("quanta_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;  // never throw from a destructor
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  /** The path of `name` inside the folder. */
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace quanta::testing
