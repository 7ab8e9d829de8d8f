// The TcpStore server under attack over loopback: lengths that wrap, clients
// that never read, bad ADDs, oversized values and quotas, strangers without
// the job token, and the address it listens on. The server runs in a child
// process (store_process.h), so a server that spins, blocks or aborts fails
// a check instead of hanging or killing this binary.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <limits>
#include <string>

#include "store_process.h"

using namespace quanta::dist;
using quanta::dist::testing::RawClient;
using quanta::dist::testing::StoreProcess;
using Clock = std::chrono::steady_clock;

namespace {

// A well-behaved client still gets prompt answers: the server is alive and
// nobody is stalling it.
void check_still_serving(int port) {
  const auto t0 = Clock::now();
  TcpStore c("127.0.0.1", port, false, Millis(1500));
  c.set_string("probe", "ok");
  CHECK(c.get_string("probe", Millis(500)) == "ok");
  CHECK(Clock::now() - t0 < std::chrono::milliseconds(1500));
}

}  // namespace

TEST_CASE("TcpStore attack: a key+value length that wraps size_t") {
  StoreProcess store;
  RawClient raw(store.port());
  REQUIRE(raw.hello());
  // 13 + 8 + (2^64 - 13) wraps to 8: an unbounded server takes this as a
  // complete request and erases only 8 of its bytes, forever.
  raw.header(RawClient::kSet, 8, std::numeric_limits<uint64_t>::max() - 12);
  raw.bytes("wrapwrap");
  REQUIRE(raw.reply(Millis(2000)));
  CHECK(raw.status() == 2);
  CHECK(raw.value().find("limit") != std::string::npos);
  // So does a key length near 2^32.
  RawClient raw2(store.port());
  REQUIRE(raw2.hello());
  raw2.header(RawClient::kGet, 0xffffffffu, 0);
  REQUIRE(raw2.reply(Millis(2000)));
  CHECK(raw2.status() == 2);
  CHECK(raw2.value().find("key of 4294967295 bytes") != std::string::npos);
  check_still_serving(store.port());
  CHECK(store.alive());
  const int ms = store.stop();
  CHECK(ms >= 0);
  CHECK(ms < 2000);
}

TEST_CASE("TcpStore attack: a client that never reads its replies stalls nobody") {
  StoreProcess store;
  {
    TcpStore c("127.0.0.1", store.port(), false, Millis(2000));
    c.set("big", Bytes(1 << 20, 'x'));
  }
  RawClient hog(store.port());
  REQUIRE(hog.hello());
  // 200 pipelined GETs of 1 MiB: far more than the socket buffers hold.
  std::string many;
  for (int i = 0; i < 200; ++i) {
    many += std::string(1, char(RawClient::kGet)) + std::string("\x03\0\0\0", 4) +
            std::string(8, '\0') + "big";
  }
  CHECK(hog.bytes(many));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  check_still_serving(store.port());
  // Also a client stuck halfway through a request.
  RawClient half(store.port());
  REQUIRE(half.hello());
  half.header(RawClient::kSet, 3, 1000);
  half.bytes("key");
  check_still_serving(store.port());
  const int ms = store.stop();  // shutdown with both still connected
  CHECK(ms >= 0);
  CHECK(ms < 2000);
}

TEST_CASE("TcpStore attack: ADD on values that are not integers gets an error reply") {
  StoreProcess store;
  TcpStore c("127.0.0.1", store.port(), false, Millis(2000));
  c.set_string("word", "abc");
  CHECK_THROWS_WITH(c.add("word", 1), doctest::Contains("'word' holds 'abc', not an integer"));
  c.set_string("huge", "99999999999999999999");
  CHECK_THROWS_WITH(c.add("huge", 1), doctest::Contains("not an integer"));
  c.set_string("max", std::to_string(std::numeric_limits<int64_t>::max()));
  CHECK_THROWS_WITH(c.add("max", 1), doctest::Contains("overflows"));
  RawClient raw(store.port());
  REQUIRE(raw.hello());
  raw.request(RawClient::kAdd, "n", "abc");  // a delta that is not 8 bytes
  REQUIRE(raw.reply(Millis(2000)));
  CHECK(raw.status() == 2);
  CHECK(raw.value().find("8-byte") != std::string::npos);
  raw.request(9, "n", "");  // an unknown command
  REQUIRE(raw.reply(Millis(2000)));
  CHECK(raw.status() == 2);
  CHECK(store.alive());
  CHECK(c.add("n", 2) == 2);
  CHECK(c.get_string("max", Millis(100)) == std::to_string(std::numeric_limits<int64_t>::max()));
}

TEST_CASE("TcpStore attack: a value over the cap is refused, naming the limit") {
  StoreProcess store;
  TcpStore c("127.0.0.1", store.port(), false, Millis(5000));
  const std::size_t cap = StoreLimits{}.max_value_bytes;
  CHECK(cap == 64u << 20);
  CHECK_THROWS_WITH(c.set("big", Bytes(cap + 1, 'x')),
                    doctest::Contains("exceeds the store's limit of 64 MiB per value"));
  c.set_string("after", "fine");  // the connection is still in step
  CHECK(c.get_string("after", Millis(100)) == "fine");
  CHECK(!c.check("big"));
  // An announced length is refused at once, before any of it arrives.
  RawClient raw(store.port());
  REQUIRE(raw.hello());
  raw.header(RawClient::kSet, 1, uint64_t(1) << 40);
  raw.bytes("k");
  REQUIRE(raw.reply(Millis(2000)));
  CHECK(raw.status() == 2);
  CHECK(raw.value().find("64 MiB per value") != std::string::npos);
  check_still_serving(store.port());
}

TEST_CASE("TcpStore attack: key count and total bytes have quotas") {
  TcpStoreOptions o;
  o.limits.max_keys = 4;
  o.limits.max_total_bytes = 1000;
  StoreProcess store(o);
  TcpStore c("127.0.0.1", store.port(), false, Millis(2000), o);
  for (const char* key : {"k0", "k1", "k2", "k3"}) c.set_string(key, "v");
  CHECK_THROWS_WITH(c.set_string("k4", "v"), doctest::Contains("limit of 4 keys"));
  CHECK_THROWS_WITH(c.add("k5", 1), doctest::Contains("limit of 4 keys"));
  c.set_string("k0", "overwriting is fine");
  CHECK(c.remove("k1"));
  c.set_string("k4", "v");  // removing freed a slot
  CHECK_THROWS_WITH(c.set("k2", Bytes(990, 'x')), doctest::Contains("limit of 1000 bytes"));
  CHECK(c.get_string("k2", Millis(100)) == "v");  // the refused set changed nothing
}

TEST_CASE("TcpStore attack: a stranger without the job token is refused on both sides") {
  TcpStoreOptions job;
  job.token = "token-of-job-a";
  StoreProcess store(job);
  // A raw connection that skips the handshake.
  RawClient stranger(store.port());
  stranger.request(RawClient::kSet, "quanta/world/seed", "1");
  REQUIRE(stranger.reply(Millis(2000)));
  CHECK(stranger.status() == 2);
  CHECK(stranger.value().find("job token") != std::string::npos);
  CHECK(stranger.closed_within(Millis(2000)));
  // A rank of another job: a clear error at once, not after the timeout.
  TcpStoreOptions other;
  other.token = "token-of-job-b";
  const auto t0 = Clock::now();
  CHECK_THROWS_WITH(TcpStore("127.0.0.1", store.port(), false, Millis(5000), other),
                    doctest::Contains("wrong job token"));
  CHECK(Clock::now() - t0 < std::chrono::seconds(2));
  CHECK(store.stderr_text().find("refused a connection from 127.0.0.1") != std::string::npos);
  CHECK(store.stderr_text().find("wrong job token") != std::string::npos);
  // The job's own ranks are served.
  TcpStore mine("127.0.0.1", store.port(), false, Millis(2000), job);
  mine.set_string("a", "1");
  CHECK(mine.get_string("a", Millis(100)) == "1");
  CHECK(!mine.check("quanta/world/seed"));  // the stranger's set never landed
}

TEST_CASE("TcpStore: the server listens on the address it is given") {
  TcpStore local("127.0.0.1", 0, true, Millis(2000));
  // The whole of 127/8 is this host: a server bound to every interface
  // would answer on 127.0.0.2 too.
  CHECK(RawClient(local.port(), "127.0.0.1").connected());
  CHECK(!RawClient(local.port(), "127.0.0.2").connected());
  TcpStoreOptions all;
  all.bind = "0.0.0.0";
  TcpStore everywhere("127.0.0.1", 0, true, Millis(2000), all);
  CHECK(RawClient(everywhere.port(), "127.0.0.2").connected());
  TcpStoreServer plain(0);  // a bare server defaults to loopback
  CHECK(!RawClient(plain.port(), "127.0.0.2").connected());
  TcpStoreOptions elsewhere;
  elsewhere.bind = "192.0.2.1";  // TEST-NET-1: not an address of this host
  CHECK_THROWS_WITH(TcpStoreServer(0, elsewhere), doctest::Contains("QUANTA_STORE_BIND_ALL"));
}
