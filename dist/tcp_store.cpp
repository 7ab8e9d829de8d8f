// TcpStore: a tiny request/reply protocol over one TCP connection per client.
//   request: u8 cmd | u32 key length | u64 value length | key | value
//   reply:   u8 status (0 ok, 1 missing) | u64 value length | value
// get() with a timeout is client-side polling of a non-blocking get, so the
// server never holds a request open and stays a single poll() loop.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "dist/store.h"

namespace quanta::dist {
namespace {

enum Cmd : uint8_t { kSet = 0, kGet = 1, kAdd = 2, kCheck = 3, kRemove = 4 };
constexpr std::size_t kHeader = 1 + 4 + 8;

using Clock = std::chrono::steady_clock;

std::string errno_text() { return std::strerror(errno); }

// Sends all of `n` bytes or throws.
void send_all(int fd, const char* p, std::size_t n, const std::string& where) {
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0)
      throw std::runtime_error("[TcpStore] lost the connection to " + where + ": " + errno_text());
    p += k;
    n -= static_cast<std::size_t>(k);
  }
}

// Receives exactly `n` bytes before `deadline` or throws.
void recv_all(int fd, char* p, std::size_t n, Clock::time_point deadline,
              const std::string& where) {
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
                               " closed the connection (the rank hosting it, normally rank 0, "
                               "has exited or was lost)");
    p += k;
    n -= static_cast<std::size_t>(k);
  }
}

template <class T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}
template <class T>
T take(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace

// ---- server ----

struct TcpStoreServer::Impl {
  int listen_fd = -1;
  int wake[2] = {-1, -1};
  int port = 0;
  std::thread thread;
  std::map<std::string, Bytes> data;

  struct Client {
    int fd;
    std::string in;
  };

  std::string handle(uint8_t cmd, const std::string& key, const std::string& value) {
    std::string reply;
    auto ok = [&](const std::string& v) {
      put<uint8_t>(reply, 0);
      put<uint64_t>(reply, v.size());
      reply += v;
    };
    auto missing = [&] {
      put<uint8_t>(reply, 1);
      put<uint64_t>(reply, 0);
    };
    switch (cmd) {
      case kSet:
        data[key] = Bytes(value.begin(), value.end());
        ok("");
        break;
      case kGet: {
        auto it = data.find(key);
        if (it == data.end())
          missing();
        else
          ok(std::string(it->second.begin(), it->second.end()));
        break;
      }
      case kAdd: {
        int64_t cur = 0;
        auto it = data.find(key);
        if (it != data.end() && !it->second.empty())
          cur = std::stoll(std::string(it->second.begin(), it->second.end()));
        cur += take<int64_t>(value.data());
        const std::string s = std::to_string(cur);
        data[key] = Bytes(s.begin(), s.end());
        ok(s);
        break;
      }
      case kCheck:
        data.count(key) ? ok("") : missing();
        break;
      case kRemove:
        data.erase(key) ? ok("") : missing();
        break;
      default:
        missing();
    }
    return reply;
  }

  void serve() {
    std::vector<Client> clients;
    for (;;) {
      std::vector<pollfd> fds{{wake[0], POLLIN, 0}, {listen_fd, POLLIN, 0}};
      for (auto& c : clients) fds.push_back({c.fd, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[0].revents) return;  // shutdown
      if (fds[1].revents & POLLIN) {
        const int fd = ::accept(listen_fd, nullptr, nullptr);
        if (fd >= 0) {
          int one = 1;
          ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          clients.push_back({fd, {}});
        }
      }
      for (std::size_t i = 2; i < fds.size(); ++i) {
        if (!fds[i].revents) continue;
        Client& c = clients[i - 2];
        char buf[65536];
        const ssize_t k = ::recv(c.fd, buf, sizeof buf, 0);
        if (k <= 0) {
          ::close(c.fd);
          c.fd = -1;
          continue;
        }
        c.in.append(buf, static_cast<std::size_t>(k));
        // Serve every complete request in the buffer.
        while (c.in.size() >= kHeader) {
          const auto klen = take<uint32_t>(c.in.data() + 1);
          const auto vlen = take<uint64_t>(c.in.data() + 5);
          if (c.in.size() < kHeader + klen + vlen) break;
          const std::string key = c.in.substr(kHeader, klen);
          const std::string value = c.in.substr(kHeader + klen, vlen);
          const std::string reply = handle(static_cast<uint8_t>(c.in[0]), key, value);
          c.in.erase(0, kHeader + klen + vlen);
          try {
            send_all(c.fd, reply.data(), reply.size(), "client");
          } catch (const std::exception&) {
            ::close(c.fd);
            c.fd = -1;
            break;
          }
        }
      }
      std::erase_if(clients, [](const Client& c) { return c.fd < 0; });
    }
  }
};

TcpStoreServer::TcpStoreServer(int port) : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.listen_fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (s.listen_fd < 0) throw std::runtime_error("[TcpStore] socket(): " + errno_text());
  int one = 1;
  ::setsockopt(s.listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(s.listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(s.listen_fd, 1024) != 0) {
    const std::string why = errno_text();
    ::close(s.listen_fd);
    throw std::runtime_error("[TcpStore] cannot listen on port " + std::to_string(port) + ": " +
                             why + " (is MASTER_PORT used by another job?)");
  }
  socklen_t len = sizeof addr;
  ::getsockname(s.listen_fd, reinterpret_cast<sockaddr*>(&addr), &len);
  s.port = ntohs(addr.sin_port);
  if (::pipe(s.wake) != 0) throw std::runtime_error("[TcpStore] pipe(): " + errno_text());
  s.thread = std::thread([&s] { s.serve(); });
}

TcpStoreServer::~TcpStoreServer() {
  const char c = 1;
  (void)!::write(impl_->wake[1], &c, 1);
  impl_->thread.join();
  ::close(impl_->listen_fd);
  ::close(impl_->wake[0]);
  ::close(impl_->wake[1]);
}

int TcpStoreServer::port() const { return impl_->port; }

// ---- client ----

struct TcpStore::Lock {
  std::mutex m;
};
struct TcpStore::Reply {
  bool found;
  std::string value;
};

namespace {

int connect_once(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res)
    throw std::runtime_error("[TcpStore] cannot resolve host '" + host + "' (MASTER_ADDR)");
  int fd = -1;
  for (addrinfo* a = res; a; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
    ::close(fd);
    fd = -1;
  }
  ::freeaddrinfo(res);
  return fd;
}

}  // namespace

TcpStore::TcpStore(const std::string& host, int port, bool is_server, Millis timeout)
    : host_(host), port_(port), timeout_(timeout), lock_(std::make_unique<Lock>()) {
  if (is_server) {
    server_ = std::make_unique<TcpStoreServer>(port);
    port_ = server_->port();
  }
  const auto deadline = Clock::now() + timeout;
  for (auto sleep = Millis(5);; sleep = std::min(sleep * 2, Millis(200))) {
    fd_ = connect_once(host_, port_);
    if (fd_ >= 0) break;
    if (Clock::now() >= deadline)
      throw std::runtime_error("[TcpStore] could not connect to " + describe() + " within " +
                               std::to_string(timeout.count()) +
                               " ms: is rank 0 running and are MASTER_ADDR/MASTER_PORT right?");
    std::this_thread::sleep_for(sleep);
  }
  int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
  server_.reset();
}

std::string TcpStore::describe() const { return "tcp://" + host_ + ":" + std::to_string(port_); }

TcpStore::Reply TcpStore::request(uint8_t cmd, const std::string& key, const Bytes& value) {
  std::string msg;
  put<uint8_t>(msg, cmd);
  put<uint32_t>(msg, static_cast<uint32_t>(key.size()));
  put<uint64_t>(msg, value.size());
  msg += key;
  msg.append(value.data(), value.size());
  std::lock_guard<std::mutex> g(lock_->m);
  const std::string where = describe();
  send_all(fd_, msg.data(), msg.size(), where);
  char head[9];
  const auto deadline = Clock::now() + std::max(timeout_, Millis(1000));
  recv_all(fd_, head, sizeof head, deadline, where);
  Reply r{head[0] == 0, std::string(take<uint64_t>(head + 1), '\0')};
  recv_all(fd_, r.value.data(), r.value.size(), deadline, where);
  return r;
}

void TcpStore::set(const std::string& key, const Bytes& value) { request(kSet, key, value); }

Bytes TcpStore::get(const std::string& key, Millis timeout) {
  const auto deadline = Clock::now() + timeout;
  for (auto sleep = Millis(1);; sleep = std::min(sleep * 2, Millis(20))) {
    Reply r = request(kGet, key, {});
    if (r.found) return Bytes(r.value.begin(), r.value.end());
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

bool TcpStore::check(const std::string& key) { return request(kCheck, key, {}).found; }
bool TcpStore::remove(const std::string& key) { return request(kRemove, key, {}).found; }

}  // namespace quanta::dist
