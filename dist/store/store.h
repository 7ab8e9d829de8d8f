#pragma once
// Key-value stores for rendezvous: every rank of a group meets through one.
// TcpStore: a server (rank 0 or a launcher) and a client per rank, the way
// torchrun's MASTER_ADDR:MASTER_PORT is used. FileStore: a directory every
// rank can see (a shared file system). PrefixStore scopes keys, so several
// groups share one store. Every blocking call has a deadline and throws an
// error naming the store, the key and the time it waited. A TcpStore server
// listens only on the address it is given, serves only connections that
// present the job's token, caps what it holds (StoreLimits), and answers
// every bad request with an error instead of stalling or dying.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace quanta::dist {

using Millis = std::chrono::milliseconds;
using Bytes = std::vector<char>;

/** The interface every store implements. Thread-safe. */
class Store {
 public:
  virtual ~Store() = default;
  /** Sets `key` to `value` (overwrites). */
  virtual void set(const std::string& key, const Bytes& value) = 0;
  /** The value of `key`, waiting up to `timeout` for it to be set; throws
   * std::runtime_error naming the key on timeout. */
  virtual Bytes get(const std::string& key, Millis timeout) = 0;
  /** Adds `delta` to the integer at `key` (0 when unset); returns the sum. */
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  /** True when `key` is set (does not wait). */
  virtual bool check(const std::string& key) = 0;
  /** Removes `key`; true when it existed. */
  virtual bool remove(const std::string& key) = 0;
  /** Where the store lives, for error messages ("tcp://127.0.0.1:29500"). */
  virtual std::string describe() const = 0;
  /** Asks the store to set `key` to `value` (non-empty) if this client
   * vanishes (its process killed) before clear_will(key), and only if `key`
   * is unset then: how a process's death reaches the others at once
   * instead of after a timeout. A store without connections ignores it. */
  virtual void set_will(const std::string& key, const Bytes& value);
  /** Withdraws set_will(key). */
  virtual void clear_will(const std::string& key);

  /** Waits until every key is set (throws like get on timeout). */
  void wait(const std::vector<std::string>& keys, Millis timeout);
  /** get() of a value set with set_string(). */
  std::string get_string(const std::string& key, Millis timeout);
  /** set() of a string value. */
  void set_string(const std::string& key, const std::string& value);
};

/** What one TcpStore server holds at most; a request past a limit gets an
 * error reply naming the limit (the store is unchanged). */
struct StoreLimits {
  std::size_t max_key_bytes = 4096;
  std::size_t max_value_bytes = std::size_t(64) << 20;
  std::size_t max_keys = std::size_t(1) << 20;
  /** Keys plus values, all entries together. */
  std::size_t max_total_bytes = std::size_t(1) << 30;
};

/** How a TcpStore server listens and whom it serves. */
struct TcpStoreOptions {
  /** The shared secret of the job: a connection must present it first, or
   * it is refused with "wrong job token" on both sides. dist::init passes
   * QUANTA_JOB_TOKEN (quanta launch sets a random one per job); this fixed
   * default only keeps stray processes out, not attackers. */
  std::string token = "quanta-default-job-token";
  /** The address the server listens on. Empty: the host the clients connect
   * to (TcpStore), 127.0.0.1 (a bare TcpStoreServer). "0.0.0.0": every
   * interface (dist::init with QUANTA_STORE_BIND_ALL=1). */
  std::string bind{};
  StoreLimits limits{};
  /** Who runs the server, for the messages of a client that cannot reach it
   * ("is rank 0 running ...?"); quanta launch's store is node 0's launcher. */
  std::string server_owner = "rank 0";
};

/** The server side of TcpStore: a thread serving one map to any number of
 * clients, never blocked by any one of them. Port 0 picks a free port (see
 * port()). */
class TcpStoreServer {
 public:
  /** Listens on `opts.bind` (default 127.0.0.1) at `port`; throws naming the
   * address and port on failure. */
  explicit TcpStoreServer(int port, TcpStoreOptions opts = {});
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;
  /** The port it listens on. */
  int port() const;
  /** Waits until no client is connected, at most `most`; false when some
   * still were. */
  bool wait_idle(Millis most);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/** A TCP store client; with `is_server` it also hosts the server. */
class TcpStore : public Store {
 public:
  /** Connects to host:port, retrying until `timeout` (the server may start
   * later; after 3 s it says on stderr what it waits for, then every 30 s),
   * and presents `opts.token`. With `is_server`, first starts a server on
   * `port` listening on `opts.bind`, else on `host`. A refused token throws
   * at once. */
  TcpStore(const std::string& host, int port, bool is_server, Millis timeout,
           TcpStoreOptions opts = {});
  ~TcpStore() override;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, Millis timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  bool remove(const std::string& key) override;
  std::string describe() const override;
  void set_will(const std::string& key, const Bytes& value) override;
  void clear_will(const std::string& key) override;
  /** The port of the server (useful with port 0 and is_server). */
  int port() const { return port_; }
  /** When this store hosts the server: on destruction, keep serving until
   * every other client has left, at most `most`, instead of closing under
   * them. A group that failed asks for it (ProcessGroup's destructor), so
   * that the ranks that see the failure later, through the connection this
   * process closes, can still ask the store which rank did not arrive. */
  void linger_on_close(Millis most) { linger_ = most; }

 private:
  struct Reply;
  Reply request(uint8_t cmd, const std::string& key, const Bytes& value,
                bool throw_on_error = true);
  void connect_and_hello();
  std::unique_ptr<TcpStoreServer> server_;
  std::string host_;
  int port_;
  Millis timeout_;
  TcpStoreOptions opts_;
  int fd_ = -1;
  Millis linger_{0};
  struct Lock;
  std::unique_ptr<Lock> lock_;
};

/** A TCP port nobody listens on now, on any interface, for a TcpStore
 * server (or MASTER_PORT) to bind moments later; another process may take it
 * in between. Throws std::runtime_error when the system gives none. */
int free_port();

/** A store in a directory: one file per key, written atomically (temporary
 * file then rename). Use a fresh directory per run: old keys are read as set. */
class FileStore : public Store {
 public:
  /** Creates `dir` if needed. */
  explicit FileStore(std::string dir);
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, Millis timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  bool remove(const std::string& key) override;
  std::string describe() const override;

 private:
  std::string path_of(const std::string& key) const;
  std::string dir_;
};

/** Keys of `base` under "prefix/". */
class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> base);
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, Millis timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  bool remove(const std::string& key) override;
  std::string describe() const override;
  void set_will(const std::string& key, const Bytes& value) override;
  void clear_will(const std::string& key) override;
  /** The store below the prefix. */
  const std::shared_ptr<Store>& base() const { return base_; }

 private:
  std::string prefix_;
  std::shared_ptr<Store> base_;
};

}  // namespace quanta::dist
