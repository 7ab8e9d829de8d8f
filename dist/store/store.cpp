// Store helpers, FileStore and PrefixStore (TcpStore lives in tcp_store.cpp).
#include "dist/store/store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>
#include <thread>

namespace quanta::dist {

void Store::wait(const std::vector<std::string>& keys, Millis timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (const auto& k : keys) {
    const auto left =
        std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
    get(k, std::max(left, Millis(0)));
  }
}

std::string Store::get_string(const std::string& key, Millis timeout) {
  const Bytes b = get(key, timeout);
  return std::string(b.begin(), b.end());
}

void Store::set_will(const std::string&, const Bytes&) {}
void Store::clear_will(const std::string&) {}

void Store::set_string(const std::string& key, const std::string& value) {
  set(key, Bytes(value.begin(), value.end()));
}

// ---- FileStore ----

namespace {

// Keys may hold '/' and other bytes a file name cannot: hex-encode them.
std::string hex_name(const std::string& key) {
  static const char* digits = "0123456789abcdef";
  std::string out = "k_";
  for (unsigned char c : key) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

bool read_file(const std::string& path, Bytes& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  out.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return true;
}

// Write to a unique temporary name, then rename: readers see all or nothing.
void write_atomic(const std::string& dir, const std::string& path, const Bytes& value) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  const std::string tmp = dir + "/.tmp." + std::to_string(::getpid()) + "." + std::to_string(rng());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out)
      throw std::runtime_error("[FileStore] cannot write " + tmp + ": " + std::strerror(errno));
    out.write(value.data(), static_cast<std::streamsize>(value.size()));
    if (!out) throw std::runtime_error("[FileStore] write failed: " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw std::runtime_error("[FileStore] rename to " + path + " failed: " + std::strerror(errno));
}

}  // namespace

FileStore::FileStore(std::string dir) : dir_(std::move(dir)) {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (!std::filesystem::is_directory(dir_))
    throw std::runtime_error("[FileStore] cannot create directory " + dir_ + ": " + ec.message());
}

std::string FileStore::path_of(const std::string& key) const { return dir_ + "/" + hex_name(key); }

void FileStore::set(const std::string& key, const Bytes& value) {
  write_atomic(dir_, path_of(key), value);
}

Bytes FileStore::get(const std::string& key, Millis timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  Bytes out;
  for (auto sleep = Millis(1);; sleep = std::min(sleep * 2, Millis(20))) {
    if (read_file(path_of(key), out)) return out;
    if (std::chrono::steady_clock::now() >= deadline)
      throw std::runtime_error("[FileStore] timed out after " + std::to_string(timeout.count()) +
                               " ms waiting for key '" + key + "' in " + dir_);
    std::this_thread::sleep_for(sleep);
  }
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  // One lock file per key serialises read-modify-write across processes.
  const std::string lock_path = path_of(key) + ".lock";
  const int fd = ::open(lock_path.c_str(), O_CREAT | O_RDWR, 0644);
  if (fd < 0) throw std::runtime_error("[FileStore] cannot open " + lock_path);
  ::flock(fd, LOCK_EX);
  int64_t value = 0;
  Bytes cur;
  if (read_file(path_of(key), cur) && !cur.empty())
    value = std::stoll(std::string(cur.begin(), cur.end()));
  value += delta;
  const std::string s = std::to_string(value);
  try {
    write_atomic(dir_, path_of(key), Bytes(s.begin(), s.end()));
  } catch (...) {
    ::flock(fd, LOCK_UN);
    ::close(fd);
    throw;
  }
  ::flock(fd, LOCK_UN);
  ::close(fd);
  return value;
}

bool FileStore::check(const std::string& key) { return ::access(path_of(key).c_str(), F_OK) == 0; }

bool FileStore::remove(const std::string& key) { return ::unlink(path_of(key).c_str()) == 0; }

std::string FileStore::describe() const { return "file://" + dir_; }

// ---- PrefixStore ----

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> base)
    : prefix_(std::move(prefix) + "/"), base_(std::move(base)) {}

void PrefixStore::set(const std::string& key, const Bytes& value) {
  base_->set(prefix_ + key, value);
}
Bytes PrefixStore::get(const std::string& key, Millis timeout) {
  return base_->get(prefix_ + key, timeout);
}
int64_t PrefixStore::add(const std::string& key, int64_t delta) {
  return base_->add(prefix_ + key, delta);
}
bool PrefixStore::check(const std::string& key) { return base_->check(prefix_ + key); }
bool PrefixStore::remove(const std::string& key) { return base_->remove(prefix_ + key); }
std::string PrefixStore::describe() const { return base_->describe() + " [" + prefix_ + "]"; }
void PrefixStore::set_will(const std::string& key, const Bytes& value) {
  base_->set_will(prefix_ + key, value);
}
void PrefixStore::clear_will(const std::string& key) { base_->clear_will(prefix_ + key); }

}  // namespace quanta::dist
