// Mooncake Store's error codes, by the same names and values as Mooncake Store (ErrorCode in
// mooncake-store/include/types.h), so that code written against Mooncake's Python API sees the
// integers it expects. docs/store_errors.md says when the store returns each one.
//
// The master's own API returns these codes (ErrorOr<T> below); they travel on the wire as
// int32 (store/proto/store.proto). Values never change once published.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>

namespace mooncake::store {

enum class ErrorCode : int32_t {
  OK = 0,
  INTERNAL_ERROR = -1,

  BUFFER_OVERFLOW = -10,

  SHARD_INDEX_OUT_OF_RANGE = -100,
  SEGMENT_NOT_FOUND = -101,
  SEGMENT_ALREADY_EXISTS = -102,
  CLIENT_NOT_FOUND = -103,

  NO_AVAILABLE_HANDLE = -200,

  INVALID_VERSION = -300,

  INVALID_KEY = -400,

  WRITE_FAIL = -500,

  INVALID_PARAMS = -600,
  ILLEGAL_CLIENT = -601,

  INVALID_WRITE = -700,
  INVALID_READ = -701,
  INVALID_REPLICA = -702,

  REPLICA_IS_NOT_READY = -703,
  OBJECT_NOT_FOUND = -704,
  OBJECT_ALREADY_EXISTS = -705,
  OBJECT_HAS_LEASE = -706,
  LEASE_EXPIRED = -707,
  OBJECT_HAS_REPLICATION_TASK = -708,
  OBJECT_NO_REPLICATION_TASK = -709,
  REPLICA_NOT_FOUND = -710,
  REPLICA_ALREADY_EXISTS = -711,
  REPLICA_IS_GONE = -712,

  TRANSFER_FAIL = -800,

  RPC_FAIL = -900,

  ETCD_OPERATION_ERROR = -1000,
  ETCD_KEY_NOT_EXIST = -1001,
  ETCD_TRANSACTION_FAIL = -1002,
  ETCD_CTX_CANCELLED = -1003,
  UNAVAILABLE_IN_CURRENT_STATUS = -1010,
  UNAVAILABLE_IN_CURRENT_MODE = -1011,

  FILE_NOT_FOUND = -1100,
  FILE_OPEN_FAIL = -1101,
  FILE_READ_FAIL = -1102,
  FILE_WRITE_FAIL = -1103,
  FILE_INVALID_BUFFER = -1104,
  FILE_LOCK_FAIL = -1105,
  FILE_INVALID_HANDLE = -1106,
};

// "OBJECT_NOT_FOUND" for ErrorCode::OBJECT_NOT_FOUND; "UNKNOWN_ERROR" for a value not above.
std::string_view errorCodeName(ErrorCode code);
inline int32_t toInt(ErrorCode code) { return static_cast<int32_t>(code); }
// Maps an integer from the wire back to a code; values not in the table become INTERNAL_ERROR
// (a peer built from a newer schema must not smuggle an undefined enum value inside).
ErrorCode errorCodeFromInt(int32_t value);

// A value or an error code (Mooncake uses tl::expected<T, ErrorCode>; this is the same idea
// without the dependency). Constructing from ErrorCode::OK is a programming error.
template <typename T>
class [[nodiscard]] ErrorOr {
 public:
  ErrorOr(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  ErrorOr(ErrorCode error) : error_(error) {}     // NOLINT
  bool ok() const { return error_ == ErrorCode::OK; }
  ErrorCode error() const { return error_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }

 private:
  ErrorCode error_ = ErrorCode::OK;
  std::optional<T> value_;
};

}  // namespace mooncake::store
