#pragma once
// Test helpers for attacking a TcpStore server: the server runs in a forked
// child process, so a server that hangs, spins or aborts fails the test
// instead of hanging or killing the test binary; and raw loopback sockets
// with receive timeouts speak the wire protocol by hand. Every wait here is
// bounded.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "dist/store/store.h"

namespace quanta::dist::testing {

/** A TcpStoreServer in a child process. Its stderr goes to a file
 * (stderr_text()). stop() destroys the server and reports how long that took. */
class StoreProcess {
 public:
  explicit StoreProcess(TcpStoreOptions opts = {}) {
    static int serial = 0;
    log_ = "/tmp/quanta_store_attack_" + std::to_string(::getpid()) + "_" +
           std::to_string(serial++) + ".log";
    int ctl[2], info[2];
    if (::pipe(ctl) != 0 || ::pipe(info) != 0) throw std::runtime_error("pipe");
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(ctl[1]);
      ::close(info[0]);
      // A crash here is the server's, reported by the parent's checks; not
      // by the test framework's handlers, which the child inherited.
      for (int sig : {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL}) std::signal(sig, SIG_DFL);
      const int log = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(log, 2);
      int32_t reply = -1;
      {
        std::unique_ptr<TcpStoreServer> s;
        try {
          s = std::make_unique<TcpStoreServer>(0, opts);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "%s\n", e.what());
          _exit(2);
        }
        const int32_t port = s->port();
        (void)!::write(info[1], &port, sizeof port);
        char c;
        while (::read(ctl[0], &c, 1) > 0) {
        }  // until the parent closes the pipe
        const auto t0 = std::chrono::steady_clock::now();
        s.reset();
        reply = static_cast<int32_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                         std::chrono::steady_clock::now() - t0)
                                         .count());
      }
      (void)!::write(info[1], &reply, sizeof reply);
      _exit(0);
    }
    ::close(ctl[0]);
    ::close(info[1]);
    ctl_ = ctl[1];
    info_ = info[0];
    int32_t port = -1;
    if (!read_for(&port, Millis(5000))) throw std::runtime_error("the store process did not start");
    port_ = port;
  }
  ~StoreProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (ctl_ >= 0) ::close(ctl_);
    ::close(info_);
    ::unlink(log_.c_str());
  }
  int port() const { return port_; }
  /** True while the server process lives (it did not abort). */
  bool alive() {
    if (pid_ <= 0) return false;
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) == 0) return true;
    pid_ = -1;
    return false;
  }
  /** Destroys the server; returns the milliseconds its destructor took, or
   * -1 when it did not return within `limit` (then the process is killed). */
  int stop(Millis limit = Millis(3000)) {
    ::close(ctl_);
    ctl_ = -1;
    int32_t ms = -1;
    if (!read_for(&ms, limit)) ms = -1;
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
    return ms;
  }
  /** What the server printed. */
  std::string stderr_text() const {
    std::ifstream in(log_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  bool read_for(int32_t* v, Millis limit) {
    pollfd p{info_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(limit.count())) != 1) return false;
    return ::read(info_, v, sizeof *v) == sizeof *v;
  }
  pid_t pid_ = -1;
  int ctl_ = -1, info_ = -1, port_ = -1;
  std::string log_;
};

/** A raw TCP connection speaking the store's wire format by hand:
 *   request: u8 cmd | u32 key length | u64 value length | key | value
 *   reply:   u8 status (0 ok, 1 missing, 2 error) | u64 length | value */
class RawClient {
 public:
  enum : uint8_t { kSet = 0, kGet = 1, kAdd = 2, kCheck = 3, kRemove = 4, kHello = 5 };
  explicit RawClient(int port, const char* addr = "127.0.0.1") {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, addr, &a.sin_addr);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    timeval tv{2, 0};  // no send may block the test for long
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  }
  ~RawClient() { ::close(fd_); }
  bool connected() const { return connected_; }
  /** Sends the job-token handshake; true when the server accepted it. */
  bool hello(const std::string& token = TcpStoreOptions{}.token) {
    request(kHello, "quanta-store/1", token);
    return reply(Millis(2000)) && status_ == 0;
  }
  void header(uint8_t cmd, uint32_t klen, uint64_t vlen) {
    std::string h(1, static_cast<char>(cmd));
    h.append(reinterpret_cast<const char*>(&klen), 4);
    h.append(reinterpret_cast<const char*>(&vlen), 8);
    bytes(h);
  }
  void request(uint8_t cmd, const std::string& key, const std::string& value) {
    header(cmd, static_cast<uint32_t>(key.size()), value.size());
    bytes(key + value);
  }
  /** Sends raw bytes; false when the connection refused them. */
  bool bytes(const std::string& b) {
    return ::send(fd_, b.data(), b.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(b.size());
  }
  /** Reads one reply within `limit`; false on timeout or a closed connection. */
  bool reply(Millis limit) {
    char head[9];
    if (!read_exact(head, 9, limit)) return false;
    status_ = static_cast<uint8_t>(head[0]);
    uint64_t n;
    std::memcpy(&n, head + 1, 8);
    if (n > (1u << 20)) return false;
    value_.assign(n, '\0');
    return read_exact(value_.data(), n, limit);
  }
  /** True when the server closes this connection within `limit`. */
  bool closed_within(Millis limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    char buf[4096];
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) != 1) continue;
      const ssize_t k = ::recv(fd_, buf, sizeof buf, 0);
      if (k <= 0) return true;
    }
    return false;
  }
  uint8_t status() const { return status_; }
  const std::string& value() const { return value_; }

 private:
  bool read_exact(char* p, std::size_t n, Millis limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (n > 0) {
      const auto left =
          std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
      if (left <= Millis(0)) return false;
      pollfd pfd{fd_, POLLIN, 0};
      if (::poll(&pfd, 1, static_cast<int>(left.count())) != 1) continue;
      const ssize_t k = ::recv(fd_, p, n, 0);
      if (k <= 0) return false;
      p += k;
      n -= static_cast<std::size_t>(k);
    }
    return true;
  }
  int fd_ = -1;
  bool connected_ = false;
  uint8_t status_ = 255;
  std::string value_;
};

}  // namespace quanta::dist::testing
