// TcpStoreServer: one thread, one poll() loop, non-blocking sockets, so no
// client can stall the others or the shutdown. Every length is checked
// before it is trusted, each client holds at most one reply in flight (a
// client that does not read it is not read from either), and every bad
// request gets an error reply naming what was wrong: the thread never throws.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <list>
#include <map>
#include <stdexcept>
#include <thread>

#include "dist/store/store.h"
#include "dist/store/tcp_store_protocol.h"

namespace quanta::dist {

using namespace detail;

namespace {

using Clock = std::chrono::steady_clock;
// A connection must present the job token this soon, or it is closed.
constexpr auto kHandshakeTime = std::chrono::seconds(10);
// A refused connection is read from (and its input dropped) this long after
// the error reply, so the reply arrives instead of a reset.
constexpr auto kDrainTime = std::chrono::seconds(2);
constexpr std::size_t kReadChunk = std::size_t(64) << 10;
constexpr int kRefusalsPrinted = 10;

std::string size_text(std::size_t n) {
  if (n >= (std::size_t(1) << 30) && n % (std::size_t(1) << 30) == 0)
    return std::to_string(n >> 30) + " GiB";
  if (n >= (std::size_t(1) << 20) && n % (std::size_t(1) << 20) == 0)
    return std::to_string(n >> 20) + " MiB";
  return std::to_string(n) + " bytes";
}

// A value quoted in an error: printable, and short.
std::string printable(const std::string& v) {
  std::string out;
  for (char c : v.substr(0, 40)) out += (c >= 32 && c < 127) ? c : '?';
  return "'" + out + (v.size() > 40 ? "...'" : "'");
}

// Compares every byte of `want` whatever `got` holds, so the time taken
// says nothing about how much of a guess was right.
bool same_token(const std::string& got, const std::string& want) {
  unsigned diff = got.size() == want.size() ? 0u : 1u;
  for (std::size_t i = 0; i < want.size(); ++i)
    diff |= static_cast<unsigned char>(want[i]) ^
            static_cast<unsigned char>(i < got.size() ? got[i] : 0);
  return diff == 0;
}

std::string peer_of(int fd) {
  sockaddr_in a{};
  socklen_t len = sizeof a;
  char ip[INET_ADDRSTRLEN] = "?";
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    ::inet_ntop(AF_INET, &a.sin_addr, ip, sizeof ip);
  return std::string(ip) + ":" + std::to_string(ntohs(a.sin_port));
}

std::string reply_of(StoreStatus status, const char* p, std::size_t n) {
  std::string r;
  r.reserve(kReplyHeader + n);
  put<uint8_t>(r, status);
  put<uint64_t>(r, n);
  r.append(p, n);
  return r;
}
std::string reply_of(StoreStatus status, const std::string& value) {
  return reply_of(status, value.data(), value.size());
}

}  // namespace

struct TcpStoreServer::Impl {
  TcpStoreOptions opts;
  int listen_fd = -1;
  int wake[2] = {-1, -1};
  int port = 0;
  std::thread thread;
  std::atomic<std::size_t> connected{0};  // clients after the last round (wait_idle)
  std::map<std::string, Bytes> data;
  std::size_t total_bytes = 0;  // keys + values in `data`
  int refusals = 0;

  enum class Stage { head, key, value };
  struct Client {
    int fd = -1;
    std::string peer;
    bool authed = false;
    bool draining = false;       // refused: the reply is out, the input is dropped
    Clock::time_point deadline;  // for the handshake, or the drain
    std::string in;              // received, not yet parsed (at most one chunk)
    std::size_t in_pos = 0;
    std::string out;  // the one reply in flight
    std::size_t out_sent = 0;
    // The request being parsed.
    Stage stage = Stage::head;
    char head[kRequestHeader];
    std::size_t head_got = 0;
    uint8_t cmd = 0;
    uint64_t klen = 0, vlen = 0;
    std::string key;
    Bytes value;
    uint64_t discard = 0;  // bytes of a refused request still to skip
    // Set when the connection ends (the client's process died) unless
    // withdrawn first: key -> value.
    std::map<std::string, Bytes> wills;
  };
  std::list<Client> clients;

  // ---- requests ----

  std::string error(const std::string& what) { return reply_of(kError, what); }

  // The room a new entry of `bytes` (key + value) needs, replacing `old`.
  std::string over_quota(const std::string& key, bool is_new, std::size_t old, std::size_t bytes) {
    const StoreLimits& l = opts.limits;
    if (is_new && data.size() >= l.max_keys)
      return error("cannot add key '" + key + "': the store holds " + std::to_string(data.size()) +
                   " keys, its limit of " + std::to_string(l.max_keys) + " keys");
    if (total_bytes - old + bytes > l.max_total_bytes)
      return error("cannot store key '" + key + "' (" + std::to_string(bytes) +
                   " bytes): the store would exceed its limit of " + size_text(l.max_total_bytes) +
                   " in all (keys and values)");
    return "";
  }

  void store(const std::string& key, Bytes value) {
    auto [it, added] = data.try_emplace(key);
    if (!added) total_bytes -= key.size() + it->second.size();
    total_bytes += key.size() + value.size();
    it->second = std::move(value);
  }

  std::string add(const std::string& key, const Bytes& delta_bytes) {
    if (delta_bytes.size() != sizeof(int64_t))
      return error("add of key '" + key + "' needs an 8-byte delta, got " +
                   std::to_string(delta_bytes.size()) + " bytes");
    const auto delta = take<int64_t>(delta_bytes.data());
    int64_t cur = 0;
    auto it = data.find(key);
    if (it != data.end() && !it->second.empty()) {
      const std::string s(it->second.begin(), it->second.end());
      const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), cur);
      if (ec != std::errc() || end != s.data() + s.size())
        return error("add of key '" + key + "': '" + key + "' holds " + printable(s) +
                     ", not an integer in the int64 range");
    }
    int64_t sum = 0;
    if (__builtin_add_overflow(cur, delta, &sum))
      return error("add of key '" + key + "' overflows int64: " + std::to_string(cur) + " + " +
                   std::to_string(delta));
    const std::string s = std::to_string(sum);
    const std::size_t old = it == data.end() ? 0 : key.size() + it->second.size();
    if (std::string e = over_quota(key, it == data.end(), old, key.size() + s.size()); !e.empty())
      return e;
    store(key, Bytes(s.begin(), s.end()));
    return reply_of(kOk, s);
  }

  std::string handle(uint8_t cmd, const std::string& key, Bytes value) {
    switch (cmd) {
      case kSet: {
        auto it = data.find(key);
        const std::size_t old = it == data.end() ? 0 : key.size() + it->second.size();
        if (std::string e = over_quota(key, it == data.end(), old, key.size() + value.size());
            !e.empty())
          return e;
        store(key, std::move(value));
        return reply_of(kOk, "");
      }
      case kGet: {
        auto it = data.find(key);
        if (it == data.end()) return reply_of(kMissing, "");
        return reply_of(kOk, it->second.data(), it->second.size());
      }
      case kAdd:
        return add(key, value);
      case kCheck:
        return reply_of(data.count(key) ? kOk : kMissing, "");
      case kRemove: {
        auto it = data.find(key);
        if (it == data.end()) return reply_of(kMissing, "");
        total_bytes -= key.size() + it->second.size();
        data.erase(it);
        return reply_of(kOk, "");
      }
      case kHello:
        return reply_of(kOk, "");  // already authenticated
      case kWill:
        break;  // per connection: will()
    }
    return error("unknown command " + std::to_string(cmd) +
                 " (is the client a quanta store client of the same version?)");
  }

  // Records (or, with an empty value, withdraws) what to set when `c` ends.
  std::string will(Client& c) {
    if (c.value.empty()) {
      c.wills.erase(c.key);
    } else {
      if (c.wills.size() >= 64 && !c.wills.count(c.key))
        return error("will of key '" + c.key + "': a connection may hold 64 wills");
      c.wills[c.key] = std::move(c.value);
    }
    return reply_of(kOk, "");
  }

  // ---- one client's bytes ----

  // Ends the request being parsed with an error reply; the rest of its bytes
  // (however many it announced) are skipped as they arrive, so the
  // connection stays in step.
  void refuse(Client& c, const std::string& why) {
    const uint64_t body = c.klen > UINT64_MAX - c.vlen ? UINT64_MAX : c.klen + c.vlen;
    c.discard = body - c.key.size() - c.value.size();
    c.out = error(why);
    next_request(c);
  }

  // A connection without the job token: told why, then closed.
  void refuse_stranger(Client& c, const std::string& why) {
    if (refusals < kRefusalsPrinted)
      std::fprintf(stderr,
                   "[TcpStore] refused a connection from %s: %s (a rank of another job, or a "
                   "stray process; every rank of a job needs the same QUANTA_JOB_TOKEN)%s\n",
                   c.peer.c_str(), why.c_str(),
                   refusals + 1 == kRefusalsPrinted ? "; further refusals are not printed" : "");
    ++refusals;
    c.out = error(why +
                  ": this store belongs to another job, or QUANTA_JOB_TOKEN differs between ranks");
    c.draining = true;
    c.deadline = Clock::now() + kDrainTime;
  }

  void next_request(Client& c) {
    c.stage = Stage::head;
    c.head_got = 0;
    c.key.clear();
    c.value = Bytes();
  }

  void on_header(Client& c) {
    c.cmd = static_cast<uint8_t>(c.head[0]);
    c.klen = take<uint32_t>(c.head + 1);
    c.vlen = take<uint64_t>(c.head + 5);
    if (!c.authed) {
      if (c.cmd != kHello)
        return refuse_stranger(c, "it sent a request (" + std::string(store_cmd_name(c.cmd)) +
                                      ") before the job token handshake");
      if (c.klen > std::strlen(kProtocol) || c.vlen > kMaxTokenBytes)
        return refuse_stranger(
            c, "wrong job token (a handshake of " + std::to_string(c.vlen) + " bytes)");
    } else if (c.klen > opts.limits.max_key_bytes) {
      return refuse(c, "key of " + std::to_string(c.klen) + " bytes exceeds the store's limit of " +
                           size_text(opts.limits.max_key_bytes) + " per key");
    }
    c.key.reserve(c.klen);
    c.stage = Stage::key;
  }

  void on_key(Client& c) {
    if (c.authed && c.vlen > opts.limits.max_value_bytes)
      return refuse(c, "value of " + std::to_string(c.vlen) + " bytes for key '" + c.key +
                           "' exceeds the store's limit of " +
                           size_text(opts.limits.max_value_bytes) + " per value");
    c.value.reserve(c.vlen);  // bounded by the check above (or the token's)
    c.stage = Stage::value;
  }

  void on_request(Client& c) {
    if (!c.authed) {
      if (c.key != kProtocol)
        return refuse_stranger(c, "it speaks protocol " + printable(c.key) + ", not " + kProtocol);
      const std::string token(c.value.begin(), c.value.end());
      if (!same_token(token, opts.token)) return refuse_stranger(c, "wrong job token");
      c.authed = true;
      c.out = reply_of(kOk, "");
    } else {
      try {
        c.out = c.cmd == kWill ? will(c) : handle(c.cmd, c.key, std::move(c.value));
      } catch (const std::exception& e) {  // out of memory, in practice
        c.out = error(std::string(store_cmd_name(c.cmd)) + " of key '" + c.key +
                      "' failed in the store server: " + e.what());
      }
    }
    next_request(c);
  }

  // Parses what `c` sent until a reply is waiting or the input runs out.
  void parse(Client& c) {
    while (c.out.empty() && !c.draining && c.fd >= 0) {
      const char* p = c.in.data() + c.in_pos;
      const std::size_t avail = c.in.size() - c.in_pos;
      if (c.discard > 0) {
        if (avail == 0) break;
        const std::size_t k = static_cast<std::size_t>(std::min<uint64_t>(c.discard, avail));
        c.discard -= k;
        c.in_pos += k;
        continue;
      }
      if (c.stage == Stage::head) {
        if (avail == 0) break;
        const std::size_t k = std::min(kRequestHeader - c.head_got, avail);
        std::memcpy(c.head + c.head_got, p, k);
        c.head_got += k;
        c.in_pos += k;
        if (c.head_got == kRequestHeader) on_header(c);
      } else if (c.stage == Stage::key && c.key.size() < c.klen) {
        if (avail == 0) break;
        const std::size_t k = std::min<std::size_t>(c.klen - c.key.size(), avail);
        c.key.append(p, k);
        c.in_pos += k;
      } else if (c.stage == Stage::key) {
        on_key(c);
      } else if (c.value.size() < c.vlen) {
        if (avail == 0) break;
        const std::size_t k =
            static_cast<std::size_t>(std::min<uint64_t>(c.vlen - c.value.size(), avail));
        c.value.insert(c.value.end(), p, p + k);
        c.in_pos += k;
      } else {
        on_request(c);
      }
      if (!c.out.empty()) flush(c);
    }
    if (c.in_pos == c.in.size()) {
      c.in.clear();
      c.in_pos = 0;
    }
  }

  void drop(Client& c) {
    if (c.fd >= 0) ::close(c.fd);
    c.fd = -1;
    // The wills of a connection that ended: a key already set (the process
    // posted before it left) keeps its value; the store's limits hold.
    for (auto& [key, value] : c.wills)
      if (!data.count(key) && over_quota(key, true, 0, key.size() + value.size()).empty())
        store(key, std::move(value));
    c.wills.clear();
  }

  // Sends what the socket takes now; the rest waits for POLLOUT.
  void flush(Client& c) {
    while (c.out_sent < c.out.size()) {
      const ssize_t k = ::send(c.fd, c.out.data() + c.out_sent, c.out.size() - c.out_sent,
                               MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) {
        c.out_sent += static_cast<std::size_t>(k);
        continue;
      }
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      return drop(c);
    }
    if (c.out.capacity() > kReadChunk)
      std::string().swap(c.out);
    else
      c.out.clear();
    c.out_sent = 0;
    if (c.draining) ::shutdown(c.fd, SHUT_WR);
  }

  void on_readable(Client& c) {
    char buf[kReadChunk];
    const ssize_t k = ::recv(c.fd, buf, sizeof buf, MSG_DONTWAIT);
    if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (k <= 0) return drop(c);
    if (c.draining) return;  // a refused connection: its input is dropped
    c.in.erase(0, c.in_pos);
    c.in_pos = 0;
    c.in.append(buf, static_cast<std::size_t>(k));
    parse(c);
  }

  void accept_all(Clock::time_point& paused_until) {
    for (;;) {
      const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        // Out of descriptors: the listen socket stays readable, so stop
        // polling it for a moment instead of spinning.
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
          paused_until = Clock::now() + std::chrono::milliseconds(100);
        return;
      }
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      Client& c = clients.emplace_back();
      c.fd = fd;
      c.peer = peer_of(fd);
      c.deadline = Clock::now() + kHandshakeTime;
    }
  }

  // One round of the loop; false when asked to stop.
  bool serve_once(Clock::time_point& paused_until) {
    std::vector<pollfd> fds{{wake[0], POLLIN, 0}};
    const bool accepting = Clock::now() >= paused_until;
    fds.push_back({accepting ? listen_fd : -1, POLLIN, 0});
    for (Client& c : clients)
      fds.push_back({c.fd, static_cast<short>(c.out.empty() ? POLLIN : POLLOUT), 0});
    if (::poll(fds.data(), fds.size(), accepting ? 1000 : 100) < 0) {
      if (errno != EINTR) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      return true;
    }
    if (fds[0].revents) return false;
    if (fds[1].revents & POLLIN) accept_all(paused_until);
    std::size_t i = 2;
    const auto now = Clock::now();
    for (Client& c : clients) {
      if (i >= fds.size()) break;  // accepted in this round
      const short ev = fds[i++].revents;
      if (c.fd < 0) continue;
      if (!c.out.empty()) {
        if (ev & POLLOUT) flush(c);
        if (c.fd >= 0 && c.out.empty())
          parse(c);
        else if (ev & (POLLERR | POLLHUP))
          drop(c);
      } else if (ev) {
        on_readable(c);
      }
      if (c.fd >= 0 && (!c.authed || c.draining) && now > c.deadline) drop(c);
    }
    clients.remove_if([](const Client& c) { return c.fd < 0; });
    connected = clients.size();
    return true;
  }

  void serve() noexcept {
    Clock::time_point paused_until{};
    for (;;) {
      try {
        if (!serve_once(paused_until)) break;
      } catch (...) {
        // Out of memory building the poll list: try again shortly rather
        // than let the thread (and the rank hosting it) die.
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    for (Client& c : clients) drop(c);
  }
};

TcpStoreServer::TcpStoreServer(int port, TcpStoreOptions opts) : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.opts = std::move(opts);
  const std::string host = s.opts.bind.empty() ? "127.0.0.1" : s.opts.bind;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || !res)
    throw std::runtime_error("[TcpStore] cannot resolve the address to listen on, '" + host +
                             "' (MASTER_ADDR)");
  sockaddr_in addr{};
  std::memcpy(&addr, res->ai_addr, sizeof addr);
  ::freeaddrinfo(res);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  s.listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (s.listen_fd < 0)
    throw std::runtime_error("[TcpStore] socket(): " + std::string(std::strerror(errno)));
  int one = 1;
  ::setsockopt(s.listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(s.listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(s.listen_fd, 1024) != 0) {
    const int err = errno;
    ::close(s.listen_fd);
    const std::string hint =
        err == EADDRNOTAVAIL
            ? host +
                  " is not an address of this host: set MASTER_ADDR to one of its addresses, "
                  "or QUANTA_STORE_BIND_ALL=1 to listen on every interface"
            : "is MASTER_PORT used by another job?";
    throw std::runtime_error("[TcpStore] cannot listen on port " + std::to_string(port) + " at " +
                             host + ": " + std::strerror(err) + " (" + hint + ")");
  }
  socklen_t len = sizeof addr;
  ::getsockname(s.listen_fd, reinterpret_cast<sockaddr*>(&addr), &len);
  s.port = ntohs(addr.sin_port);
  if (::pipe2(s.wake, O_CLOEXEC) != 0) {
    ::close(s.listen_fd);
    throw std::runtime_error("[TcpStore] pipe(): " + std::string(std::strerror(errno)));
  }
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

bool TcpStoreServer::wait_idle(Millis most) {
  const auto until = std::chrono::steady_clock::now() + most;
  // The serve loop notices a closed client within its poll; check often.
  while (impl_->connected > 0) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

}  // namespace quanta::dist
