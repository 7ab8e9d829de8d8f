#pragma once
// TcpStore's wire format, shared by the client (tcp_store.cpp) and the server
// (tcp_store_server.cpp):
//   request: u8 cmd | u32 key length | u64 value length | key | value
//   reply:   u8 status | u64 value length | value
// A connection starts with HELLO (key kProtocol, value the job token); the
// server answers anything else first with an error and closes. An error
// reply's value is the message, naming what was wrong.
#include <cstdint>
#include <cstring>
#include <string>

namespace quanta::dist::detail {

// WILL: the server sets key to value when this connection ends before a WILL
// of the key with an empty value withdraws it (and only if the key is unset
// then): how a process that is killed tells the others at once.
enum StoreCmd : uint8_t {
  kSet = 0,
  kGet = 1,
  kAdd = 2,
  kCheck = 3,
  kRemove = 4,
  kHello = 5,
  kWill = 6
};
enum StoreStatus : uint8_t { kOk = 0, kMissing = 1, kError = 2 };

constexpr std::size_t kRequestHeader = 1 + 4 + 8;
constexpr std::size_t kReplyHeader = 1 + 8;
/** HELLO's key: the protocol and its version. */
constexpr const char* kProtocol = "quanta-store/1";
/** Longest token a HELLO may carry (before it, nothing bigger is read). */
constexpr std::size_t kMaxTokenBytes = 1024;

inline const char* store_cmd_name(uint8_t cmd) {
  switch (cmd) {
    case kSet:
      return "set";
    case kGet:
      return "get";
    case kAdd:
      return "add";
    case kCheck:
      return "check";
    case kRemove:
      return "remove";
    case kHello:
      return "hello";
    case kWill:
      return "will";
  }
  return "unknown command";
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

}  // namespace quanta::dist::detail
