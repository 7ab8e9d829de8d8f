#include "engine/io/atomic_file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace quanta::io {
namespace {

[[noreturn]] void fail(const char* op, const std::string& what) {
  throw std::runtime_error(std::string("[") + op + "] " + what + ": " + std::strerror(errno));
}

void write_all(int fd, const void* data, uint64_t n, const std::string& path, const char* op) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const std::size_t chunk = static_cast<std::size_t>(std::min<uint64_t>(n, 1u << 30));
    const ssize_t put = ::write(fd, p, chunk);
    if (put < 0) {
      if (errno == EINTR) continue;
      fail(op, "writing " + path + " failed");
    }
    p += put;
    n -= static_cast<uint64_t>(put);
  }
}

std::string folder_of(const std::string& path) {
  const auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Makes a rename in the folder of `path` durable. Some file systems cannot
// fsync a folder (EINVAL): the entry is in place, so that is not an error.
void sync_folder_of(const std::string& path, const char* op) {
  const int dir = ::open(folder_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return;
  const bool synced = ::fsync(dir) == 0 || errno == EINVAL || errno == ENOTSUP;
  ::close(dir);
  if (!synced) fail(op, path + " was written but fsync of its folder failed");
}

bool same_file(int fd, const std::string& path) {
  struct stat by_fd = {};
  struct stat by_path = {};
  return ::fstat(fd, &by_fd) == 0 && ::lstat(path.c_str(), &by_path) == 0 &&
         by_fd.st_dev == by_path.st_dev && by_fd.st_ino == by_path.st_ino;
}

// Whether `name` is `base` + ".tmp." + a process id.
bool is_temporary_of(const std::string& name, const std::string& base) {
  const std::string prefix = base + ".tmp.";
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return false;
  return std::all_of(name.begin() + static_cast<std::ptrdiff_t>(prefix.size()), name.end(),
                     [](char c) { return c >= '0' && c <= '9'; });
}

// The temporary files in `folder` (NAME.tmp.PID) by NAME, listed at the
// first write into the folder in this process: a process that writes many
// files into one folder lists it once, not once a file.
std::vector<std::string>& temporaries_of(const std::string& folder, const std::string& base) {
  static auto* listed = new std::map<std::string, std::map<std::string, std::vector<std::string>>>;
  auto [at, first] = listed->try_emplace(folder);
  if (first) {
    namespace fs = std::filesystem;
    std::error_code ec;
    for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      const auto dot = name.rfind(".tmp.");
      if (dot != std::string::npos && dot > 0 && is_temporary_of(name, name.substr(0, dot)))
        at->second[name.substr(0, dot)].push_back(name);
    }
  }
  return at->second[base];
}

// Removes the temporary files of `path` whose writers are gone: a process
// killed while writing (a checkpoint under SIGKILL, a lost node) leaves one
// as large as the file. A live writer holds a lock on its own for as long as
// it writes (the kernel drops it when the process dies, also across hosts
// on a shared file system), so a file whose lock can be taken is stale.
void remove_stale_temporaries(const std::string& path, const std::string& own) {
  static std::mutex mutex;
  const std::lock_guard<std::mutex> lock(mutex);
  const std::string folder = folder_of(path);
  const std::string own_name = std::filesystem::path(own).filename().string();
  std::vector<std::string>& names =
      temporaries_of(folder, std::filesystem::path(path).filename().string());
  std::erase_if(names, [&](const std::string& name) {
    if (name == own_name) return false;
    const std::string candidate = folder + "/" + name;
    const int fd = ::open(candidate.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return errno == ENOENT;  // gone: nothing left to do
    // Still the file that was locked (not one made at that name since).
    const bool stale = ::flock(fd, LOCK_EX | LOCK_NB) == 0 && same_file(fd, candidate);
    if (stale) ::unlink(candidate.c_str());
    ::close(fd);
    return stale;  // a live writer's stays listed, for a later write to try again
  });
}

}  // namespace

AtomicFileWriter::AtomicFileWriter(std::string path, const char* op)
    : path_(std::move(path)), tmp_(path_ + ".tmp." + std::to_string(::getpid())), op_(op) {
  // Created, then locked for as long as it is written (see
  // remove_stale_temporaries); a sweep by another writer that took it
  // between the two leaves a name that is no longer this file: made again.
  for (int attempt = 0; fd_ < 0; ++attempt) {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd_ < 0) fail(op_, "cannot create " + tmp_);
    if (::flock(fd_, LOCK_EX | LOCK_NB) == 0 && same_file(fd_, tmp_)) break;
    ::close(fd_);
    fd_ = -1;
    if (attempt == 8) fail(op_, "cannot lock " + tmp_ + ", which another writer holds");
    ::usleep(1000);  // the sweep that holds it unlinks it at once
  }
  remove_stale_temporaries(path_, tmp_);
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ < 0) return;  // committed
  ::close(fd_);
  ::unlink(tmp_.c_str());
}

void AtomicFileWriter::write(ByteSpan piece) {
  if (fd_ < 0) throw std::logic_error(std::string("[") + op_ + "] " + path_ + " is committed");
  if (piece.size > 0) write_all(fd_, piece.data, piece.size, tmp_, op_);
}

void AtomicFileWriter::commit() {
  if (fd_ < 0) throw std::logic_error(std::string("[") + op_ + "] " + path_ + " is committed");
  if (::fsync(fd_) != 0) fail(op_, "fsync of " + tmp_ + " failed");
  const int closed = ::close(fd_);
  fd_ = -1;
  try {
    if (closed != 0) fail(op_, "closing " + tmp_ + " failed");
    if (::rename(tmp_.c_str(), path_.c_str()) != 0)
      fail(op_, "cannot rename " + tmp_ + " to " + path_);
  } catch (...) {
    ::unlink(tmp_.c_str());
    throw;
  }
  sync_folder_of(path_, op_);
}

void write_file_atomic(const std::string& path, const std::vector<ByteSpan>& pieces,
                       const char* op) {
  AtomicFileWriter file(path, op);
  for (const ByteSpan& piece : pieces) file.write(piece);
  file.commit();
}

void write_text_atomic(const std::string& path, const std::string& text, const char* op) {
  write_file_atomic(path, {{text.data(), text.size()}}, op);
}

void replace_folder(const std::string& staged, const std::string& dir, const char* op) {
  namespace fs = std::filesystem;
  std::string target = dir;
  while (target.size() > 1 && target.back() == '/') target.pop_back();
  if (!fs::exists(target)) {
    if (::rename(staged.c_str(), target.c_str()) != 0)
      fail(op, "cannot rename " + staged + " to " + target);
  } else if (::renameat2(AT_FDCWD, staged.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) ==
             0) {
    fs::remove_all(staged);  // the old contents
  } else if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) {
    for (const auto& entry : fs::directory_iterator(staged)) {
      const std::string to = (fs::path(target) / entry.path().filename()).string();
      if (::rename(entry.path().c_str(), to.c_str()) != 0)
        fail(op, "cannot rename " + entry.path().string() + " to " + to);
    }
    fs::remove_all(staged);
  } else {
    fail(op, "cannot exchange " + staged + " and " + target);
  }
  sync_folder_of(target, op);
}

}  // namespace quanta::io
