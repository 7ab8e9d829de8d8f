// Rendezvous: a rank started twice fails the ranks that meet it, naming the
// rank, instead of hanging in Gloo's connect; a rank left alone says on
// stderr what it waits for within seconds.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "dist/process_group.h"
#include "dist/store/store.h"

using namespace quanta::dist;
using Clock = std::chrono::steady_clock;

namespace {

// What this process writes to stderr while it lives.
class CaptureStderr {
 public:
  CaptureStderr() : path_("/tmp/quanta_rendezvous_stderr_" + std::to_string(::getpid())) {
    std::fflush(stderr);
    saved_ = ::dup(2);
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 2);
    ::close(fd);
  }
  ~CaptureStderr() {
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    ::unlink(path_.c_str());
  }
  std::string text() const {
    std::fflush(stderr);
    std::ifstream in(path_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  std::string path_;
  int saved_ = -1;
};

struct Outcome {
  std::string error;
  Millis took{0};
};

// Starts one thread per entry of `ranks` (duplicates allowed), each joining
// a group of `world` ranks; returns what each one threw and when.
std::vector<Outcome> join(const std::vector<int>& ranks, int world, Millis timeout) {
  static int run = 0;
  TcpStoreServer server(0);
  GroupOptions opts;
  opts.timeout = timeout;
  opts.debug = 0;
  opts.seed = 1;
  opts.name = "rendezvous" + std::to_string(run++);
  std::vector<Outcome> out(ranks.size());
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < ranks.size(); ++i)
    threads.emplace_back([&, i] {
      const auto t0 = Clock::now();
      try {
        auto store = std::make_shared<TcpStore>("127.0.0.1", server.port(), false, Millis(5000));
        ProcessGroup g(store, ranks[i], world, opts);
      } catch (const std::exception& e) {
        out[i].error = e.what();
      }
      out[i].took = std::chrono::duration_cast<Millis>(Clock::now() - t0);
    });
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace

TEST_CASE("rendezvous: a rank started twice fails every rank that meets it, naming the rank") {
  // Rank 2 never comes, so all three meet at the rendezvous: without the
  // check they would wait in Gloo's connect for the whole 20 s.
  const auto out = join({0, 1, 1}, 3, Millis(20000));
  for (const Outcome& o : out) {
    CAPTURE(o.error);
    CHECK(o.error.find("rank 1 was started twice") != std::string::npos);
    CHECK(o.error.find("pid ") != std::string::npos);
    CHECK(o.took < Millis(8000));
  }
}

TEST_CASE("rendezvous: two processes with the same rank in a full world never hang") {
  // World of 2 with ranks 0, 1, 1: whichever rank 1 claims second fails at
  // once; the others fail too when they see it at the rendezvous, or (when
  // it came after they met) carry on. Nobody waits out the timeout.
  const auto out = join({0, 1, 1}, 2, Millis(10000));
  int named = 0;
  for (const Outcome& o : out) {
    CAPTURE(o.error);
    CHECK(o.took < Millis(8000));
    if (!o.error.empty()) CHECK(o.error.find("rank 1 was started twice") != std::string::npos);
    named += !o.error.empty();
  }
  CHECK(named >= 1);
}

TEST_CASE("rendezvous: a lone rank says what it waits for within seconds") {
  CaptureStderr captured;
  // The group's server first: a port probed and closed before it opens could
  // be handed to it by the kernel, and the lone client would then connect.
  TcpStoreServer server(0);
  // A port held bound but not listening: connecting is refused, and no other
  // process (the suites run side by side) can start a server on it meanwhile.
  const int holder = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(holder >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  REQUIRE(::bind(holder, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(::getsockname(holder, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  const int free_port = ntohs(addr.sin_port);
  std::string store_error;
  std::thread lone_client([&] {  // a rank whose store server never starts
    try {
      TcpStore("127.0.0.1", free_port, false, Millis(4000));
    } catch (const std::exception& e) {
      store_error = e.what();
    }
  });
  std::string group_error;
  {  // rank 0 of 2; rank 1 never starts
    auto store = std::make_shared<TcpStore>("127.0.0.1", server.port(), false, Millis(5000));
    GroupOptions opts;
    opts.timeout = Millis(4500);
    opts.name = "lone";
    try {
      ProcessGroup g(store, 0, 2, opts);
    } catch (const std::exception& e) {
      group_error = e.what();
    }
  }
  lone_client.join();
  ::close(holder);
  const std::string text = captured.text();
  CAPTURE(text);
  CAPTURE(group_error);
  CAPTURE(store_error);
  const std::string where = "tcp://127.0.0.1:" + std::to_string(server.port());
  CHECK(text.find("[dist] rank 0 of 2: waiting at " + where +
                  " (group 'lone') for rank 1 to join "
                  "(1 of 2 joined; waited 3 s of 4500 ms)") != std::string::npos);
  CHECK(group_error.find("timed out after 4500 ms waiting at " + where) != std::string::npos);
  CHECK(group_error.find("for rank 1 to join (1 of 2 joined)") != std::string::npos);
  CHECK(text.find("[TcpStore] waiting for the store server at tcp://127.0.0.1:" +
                  std::to_string(free_port) + " (Connection refused; waited 3 s of 4 s)") !=
        std::string::npos);
  CHECK(store_error.find("could not connect") != std::string::npos);
}
