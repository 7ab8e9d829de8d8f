// TcpStore, the client: one TCP connection per client, the wire format of
// tcp_store_protocol.h, and the job token presented once after connecting.
// get() with a timeout is client-side polling of a non-blocking get, so the
// server never holds a request open and stays a single poll() loop
// (tcp_store_server.cpp).
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "dist/store/store.h"
#include "dist/store/tcp_store_protocol.h"
#include "dist/store/wait_report.h"

namespace quanta::dist {

using namespace detail;

namespace {

using Clock = std::chrono::steady_clock;

std::string errno_text() { return std::strerror(errno); }

// What a client says when its server is gone, however it found out (a
// send that fails, a receive that ends): whose process to look at.
std::string server_gone(const std::string& owner) {
  return owner + ", which hosts it, has exited or was lost";
}

// Sends all of `n` bytes or throws.
void send_all(int fd, const char* p, std::size_t n, const std::string& where,
              const std::string& owner) {
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))  // SO_SNDTIMEO ran out
      throw std::runtime_error("[TcpStore] could not send to " + where +
                               " in time (the server is not reading)");
    if (k <= 0)
      throw std::runtime_error("[TcpStore] lost the connection to the store server at " + where +
                               " (" + errno_text() + "): " + server_gone(owner));
    p += k;
    n -= static_cast<std::size_t>(k);
  }
}

// Receives exactly `n` bytes before `deadline` or throws.
void recv_all(int fd, char* p, std::size_t n, Clock::time_point deadline, const std::string& where,
              const std::string& owner) {
  while (n > 0) {
    const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now()).count();
    if (left <= 0)
      throw std::runtime_error("[TcpStore] no reply from " + where +
                               " in time (server busy or lost)");
    pollfd pfd{fd, POLLIN, 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(left));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0)
      throw std::runtime_error("[TcpStore] the store server at " + where +
                               " closed the connection: " + server_gone(owner));
    p += k;
    n -= static_cast<std::size_t>(k);
  }
}

}  // namespace

// ---- client ----

struct TcpStore::Lock {
  std::mutex m;
};
struct TcpStore::Reply {
  uint8_t status;
  std::string value;
  bool found() const { return status == kOk; }
};

namespace {

// A connected socket, or -1 with errno saying why not.
int connect_once(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res)
    throw std::runtime_error("[TcpStore] cannot resolve host '" + host + "' (MASTER_ADDR)");
  int fd = -1;
  for (addrinfo* a = res; a; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
    const int err = errno;
    ::close(fd);
    errno = err;
    fd = -1;
  }
  ::freeaddrinfo(res);
  return fd;
}

}  // namespace

TcpStore::TcpStore(const std::string& host, int port, bool is_server, Millis timeout,
                   TcpStoreOptions opts)
    : host_(host),
      port_(port),
      timeout_(timeout),
      opts_(std::move(opts)),
      lock_(std::make_unique<Lock>()) {
  if (is_server) {
    TcpStoreOptions server_opts = opts_;
    if (server_opts.bind.empty()) server_opts.bind = host;
    server_ = std::make_unique<TcpStoreServer>(port, server_opts);
    port_ = server_->port();
  }
  connect_and_hello();
}

void TcpStore::connect_and_hello() {
  const auto deadline = Clock::now() + timeout_;
  WaitReport report(timeout_);
  for (auto sleep = Millis(5);; sleep = std::min(sleep * 2, Millis(200))) {
    fd_ = connect_once(host_, port_);
    if (fd_ >= 0) break;
    const std::string why = errno_text();
    if (Clock::now() >= deadline)
      throw std::runtime_error("[TcpStore] could not connect to " + describe() + " within " +
                               std::to_string(timeout_.count()) + " ms (" + why + "): is " +
                               opts_.server_owner +
                               " running, and are MASTER_ADDR/MASTER_PORT right?");
    if (report.due())
      std::fprintf(stderr,
                   "[TcpStore] waiting for the store server at %s (%s; %s): is %s, which hosts "
                   "it, running, and are MASTER_ADDR/MASTER_PORT right?\n",
                   describe().c_str(), why.c_str(), report.waited().c_str(),
                   opts_.server_owner.c_str());
    std::this_thread::sleep_for(sleep);
  }
  int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  // A send the server does not take within the timeout fails instead of
  // blocking this rank forever.
  const Millis limit = std::max(timeout_, Millis(1000));
  timeval tv{static_cast<time_t>(limit.count() / 1000),
             static_cast<suseconds_t>(limit.count() % 1000 * 1000)};
  ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  const Reply r = request(kHello, kProtocol, Bytes(opts_.token.begin(), opts_.token.end()), false);
  if (r.status != kOk) {
    ::close(fd_);
    fd_ = -1;
    throw std::runtime_error("[TcpStore] the store at " + describe() +
                             " refused this connection: " + r.value);
  }
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
  if (server_ && linger_.count() > 0) server_->wait_idle(linger_);
  server_.reset();
}

int free_port() {
  // Any interface: the port must be free wherever the server may listen
  // (TcpStoreOptions::bind can be 0.0.0.0). Port 0 asks the kernel to pick.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof addr;
  const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const std::string why = ok ? "" : errno_text();
  if (fd >= 0) ::close(fd);
  if (!ok) throw std::runtime_error("[free_port] cannot find a free TCP port: " + why);
  return ntohs(addr.sin_port);
}

std::string TcpStore::describe() const { return "tcp://" + host_ + ":" + std::to_string(port_); }

TcpStore::Reply TcpStore::request(uint8_t cmd, const std::string& key, const Bytes& value,
                                  bool throw_on_error) {
  std::string head_and_key;
  put<uint8_t>(head_and_key, cmd);
  put<uint32_t>(head_and_key, static_cast<uint32_t>(key.size()));
  put<uint64_t>(head_and_key, value.size());
  head_and_key += key;
  std::lock_guard<std::mutex> g(lock_->m);
  const std::string where = describe();
  send_all(fd_, head_and_key.data(), head_and_key.size(), where, opts_.server_owner);
  send_all(fd_, value.data(), value.size(), where, opts_.server_owner);  // values can be large
  char head[kReplyHeader];
  const auto deadline = Clock::now() + std::max(timeout_, Millis(1000));
  recv_all(fd_, head, sizeof head, deadline, where, opts_.server_owner);
  const auto n = take<uint64_t>(head + 1);
  // A server (or whatever answers on that port) cannot make us allocate
  // more than the largest value we would accept ourselves.
  if (n > opts_.limits.max_value_bytes + (std::size_t(64) << 10))
    throw std::runtime_error("[TcpStore] the reply from " + where + " announces " +
                             std::to_string(n) + " bytes, more than the store's limit: is " +
                             where + " a quanta store?");
  Reply r{static_cast<uint8_t>(head[0]), std::string(n, '\0')};
  recv_all(fd_, r.value.data(), r.value.size(), deadline, where, opts_.server_owner);
  if (r.status == kError && throw_on_error)
    throw std::runtime_error("[TcpStore] " + std::string(store_cmd_name(cmd)) + " of key '" + key +
                             "' at " + where + " failed: " + r.value);
  return r;
}

void TcpStore::set(const std::string& key, const Bytes& value) { request(kSet, key, value); }

Bytes TcpStore::get(const std::string& key, Millis timeout) {
  const auto deadline = Clock::now() + timeout;
  for (auto sleep = Millis(1);; sleep = std::min(sleep * 2, Millis(20))) {
    Reply r = request(kGet, key, {});
    if (r.found()) return Bytes(r.value.begin(), r.value.end());
    if (Clock::now() >= deadline)
      throw std::runtime_error("[TcpStore] timed out after " + std::to_string(timeout.count()) +
                               " ms waiting for key '" + key + "' at " + describe());
    std::this_thread::sleep_for(sleep);
  }
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  Bytes v(sizeof delta);
  std::memcpy(v.data(), &delta, sizeof delta);
  return std::stoll(request(kAdd, key, v).value);
}

bool TcpStore::check(const std::string& key) { return request(kCheck, key, {}).found(); }
bool TcpStore::remove(const std::string& key) { return request(kRemove, key, {}).found(); }

void TcpStore::set_will(const std::string& key, const Bytes& value) {
  if (value.empty()) throw std::invalid_argument("[TcpStore] a will needs a value");
  request(kWill, key, value);
}
void TcpStore::clear_will(const std::string& key) { request(kWill, key, {}); }

}  // namespace quanta::dist
