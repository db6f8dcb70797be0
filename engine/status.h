// Status and Result<T>: the error currency inside the engine and the services above it.
// No exceptions cross engine threads; the pg/torch boundary turns a Status into an exception.
#pragma once

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

namespace mooncake {

enum class Code : int {
  kOk = 0,
  kInvalidArgument,
  kNotFound,
  kAlreadyExists,
  kPermissionDenied,  // wrong secret, access outside registered memory
  kOutOfRange,
  kTimeout,
  kPeerDead,  // the peer process died or its connection broke
  kUnavailable,
  kResourceExhausted,
  kProtocol,  // malformed or truncated wire message
  kIo,
  kNotSupported,
  kCancelled,
  kInternal,
};

const char* codeName(Code c);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string msg) : code_(code), msg_(std::move(msg)) {}
  static Status OK() { return Status(); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return msg_; }
  std::string toString() const {
    return ok() ? std::string("OK") : std::string(codeName(code_)) + ": " + msg_;
  }

 private:
  Code code_ = Code::kOk;
  std::string msg_;
};

// Builds a message from stream pieces: MC_STATUS(kTimeout, "peer " << p << " silent").
#define MC_STATUS(code, stream_expr)                         \
  ::mooncake::Status(::mooncake::Code::code, [&] {           \
    std::ostringstream mc_os_;                               \
    mc_os_ << stream_expr;                                   \
    return mc_os_.str();                                     \
  }())

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {}  // NOLINT
  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T& operator*() & { return *value_; }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }

 private:
  Status status_;
  std::optional<T> value_;
};

#define MC_CONCAT_INNER_(a, b) a##b
#define MC_CONCAT_(a, b) MC_CONCAT_INNER_(a, b)

#define MC_RETURN_IF_ERROR(expr)              \
  do {                                        \
    ::mooncake::Status mc_st_ = (expr);       \
    if (!mc_st_.ok()) return mc_st_;          \
  } while (0)

#define MC_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()

#define MC_ASSIGN_OR_RETURN(lhs, expr) \
  MC_ASSIGN_OR_RETURN_IMPL_(MC_CONCAT_(mc_res_, __LINE__), lhs, expr)

}  // namespace mooncake
