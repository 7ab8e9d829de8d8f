// Stores: TCP and file, set/get/add/check/remove, timeouts with clear errors.
#include <doctest/doctest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "dist/store/store.h"

using namespace quanta::dist;

namespace {

void exercise(Store& s, Store& other) {
  s.set_string("a", "hello");
  CHECK(other.get_string("a", Millis(100)) == "hello");
  CHECK(other.check("a"));
  CHECK(!other.check("b"));
  CHECK(s.add("n", 2) == 2);
  CHECK(other.add("n", 5) == 7);
  s.set("bin", Bytes{'\0', 'x', '\0'});
  CHECK(other.get("bin", Millis(100)) == Bytes{'\0', 'x', '\0'});
  CHECK(other.remove("a"));
  CHECK(!s.check("a"));
  // get waits for a key set later by another client
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    s.set_string("late", "v");
  });
  CHECK(other.get_string("late", Millis(2000)) == "v");
  setter.join();
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(other.get("never", Millis(150)), doctest::Contains("waiting for key 'never'"));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(1000));
}

}  // namespace

TEST_CASE("TcpStore: a server and two clients") {
  TcpStore server_and_client("127.0.0.1", 0, true, Millis(2000));
  TcpStore client("127.0.0.1", server_and_client.port(), false, Millis(2000));
  exercise(server_and_client, client);
  PrefixStore p1(
      "g1", std::make_shared<TcpStore>("127.0.0.1", server_and_client.port(), false, Millis(1000)));
  p1.set_string("k", "1");
  CHECK(client.get_string("g1/k", Millis(100)) == "1");
}

TEST_CASE("TcpStore: a client's will is set when its connection ends, unless withdrawn") {
  TcpStore host("127.0.0.1", 0, true, Millis(2000));
  const auto client = [&] {
    return std::make_shared<TcpStore>("127.0.0.1", host.port(), false, Millis(2000));
  };
  const auto gone = [&](const std::string& key) {
    // The server sees the closed connection within its poll.
    return host.get_string(key, Millis(2000));
  };
  {
    PrefixStore dying("g", client());
    dying.set_will("status/1", Bytes{'d', 'e', 'a', 'd'});
    CHECK_FALSE(host.check("g/status/1"));  // not while it lives
  }
  CHECK(gone("g/status/1") == "dead");
  {
    auto c = client();
    c->set_will("withdrawn", Bytes{'x'});
    c->clear_will("withdrawn");
    c->set_will("posted", Bytes{'x'});
    c->set_string("posted", "its own word");  // a status posted before leaving is kept
    c->set_will("second", Bytes{'y'});
    c->set_will("second", Bytes{'z'});  // the last will counts
  }
  CHECK(gone("second") == "z");
  CHECK(host.get_string("posted", Millis(100)) == "its own word");
  CHECK_FALSE(host.check("withdrawn"));
  CHECK_THROWS_WITH(host.set_will("k", Bytes{}), doctest::Contains("a will needs a value"));
  // A connection holds a bounded number of wills.
  auto c = client();
  for (int i = 0; i < 64; ++i) c->set_will("w" + std::to_string(i), Bytes{'1'});
  CHECK_THROWS_WITH(c->set_will("w64", Bytes{'1'}), doctest::Contains("may hold 64 wills"));
  c->set_will("w0", Bytes{'2'});  // replacing one is fine
}

TEST_CASE("TcpStore: a server that goes away is named by whoever hosts it") {
  // Whether the client finds out in a send or a receive, the message says
  // whose process to look at.
  auto server = std::make_unique<TcpStoreServer>(0);
  TcpStore client("127.0.0.1", server->port(), false, Millis(2000));
  client.set_string("k", "v");
  server.reset();  // its connections close with it
  CHECK_THROWS_WITH(client.set_string("k", "w"),
                    doctest::Contains("rank 0, which hosts it, has exited or was lost"));
}

TEST_CASE("TcpStore: no server means a clear error after the timeout") {
  TcpStoreServer s(0);
  const int port = s.port();
  {
    TcpStoreServer gone(0);  // a port that was free
  }
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(TcpStore("127.0.0.1", 1, false, Millis(300)),
                    doctest::Contains("could not connect"));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(3));
  // The message names who should be running the server: rank 0 by default,
  // node 0's launcher for quanta launch's own store.
  CHECK_THROWS_WITH(TcpStore("127.0.0.1", 1, false, Millis(100)),
                    doctest::Contains("is rank 0 running"));
  TcpStoreOptions launcher;
  launcher.server_owner = "node 0's quanta launch (--node-rank 0)";
  CHECK_THROWS_WITH(TcpStore("127.0.0.1", 1, false, Millis(100), launcher),
                    doctest::Contains("is node 0's quanta launch (--node-rank 0) running"));
  CHECK_THROWS_WITH(TcpStore("127.0.0.1", port, true, Millis(300)),
                    doctest::Contains("cannot listen on port"));
}

TEST_CASE("TcpStore: a server that goes away is reported") {
  auto server = std::make_unique<TcpStoreServer>(0);
  TcpStore client("127.0.0.1", server->port(), false, Millis(500));
  client.set_string("x", "1");
  server.reset();
  CHECK_THROWS_WITH(client.get("x", Millis(200)), doctest::Contains("TcpStore"));
}

TEST_CASE("FileStore: two handles on one directory") {
  const std::string dir = "/tmp/quanta_filestore_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  FileStore a(dir), b(dir);
  exercise(a, b);
  std::filesystem::remove_all(dir);
}
