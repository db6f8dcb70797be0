#include "engine/status.h"

namespace mooncake {

const char* codeName(Code c) {
  switch (c) {
    case Code::kOk: return "OK";
    case Code::kInvalidArgument: return "INVALID_ARGUMENT";
    case Code::kNotFound: return "NOT_FOUND";
    case Code::kAlreadyExists: return "ALREADY_EXISTS";
    case Code::kPermissionDenied: return "PERMISSION_DENIED";
    case Code::kOutOfRange: return "OUT_OF_RANGE";
    case Code::kTimeout: return "TIMEOUT";
    case Code::kPeerDead: return "PEER_DEAD";
    case Code::kUnavailable: return "UNAVAILABLE";
    case Code::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case Code::kProtocol: return "PROTOCOL";
    case Code::kIo: return "IO";
    case Code::kNotSupported: return "NOT_SUPPORTED";
    case Code::kCancelled: return "CANCELLED";
    case Code::kInternal: return "INTERNAL";
  }
  return "UNKNOWN";
}

}  // namespace mooncake
