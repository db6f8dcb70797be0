// Logging by level x subsystem (MC_LOG_LEVEL, MC_LOG_SUBSYS), as NCCL_DEBUG/NCCL_DEBUG_SUBSYS.
// MC_LOG(WARN, TCP) << "peer " << p << " reset";   -- the stream is not evaluated when off.
#pragma once

#include <cstdint>
#include <sstream>

namespace mooncake::log {

enum Level : int { ERROR = 0, WARN = 1, INFO = 2, DEBUG = 3, TRACE = 4 };
enum Subsys : uint32_t {
  ENGINE = 1u << 0,
  SHM = 1u << 1,
  TCP = 1u << 2,
  RDMA = 1u << 3,
  CUDA = 1u << 4,
  PG = 1u << 5,
  EP = 1u << 6,
  STORE = 1u << 7,
};

bool enabled(Level level, Subsys subsys);
void emit(Level level, Subsys subsys, const char* file, int line, const std::string& msg);

class Line {
 public:
  Line(Level l, Subsys s, const char* f, int n) : l_(l), s_(s), f_(f), n_(n) {}
  ~Line() { emit(l_, s_, f_, n_, os_.str()); }
  std::ostringstream& stream() { return os_; }

 private:
  Level l_;
  Subsys s_;
  const char* f_;
  int n_;
  std::ostringstream os_;
};

}  // namespace mooncake::log

#define MC_LOG(level, subsys)                                                           \
  if (!::mooncake::log::enabled(::mooncake::log::level, ::mooncake::log::subsys)) {     \
  } else                                                                                \
    ::mooncake::log::Line(::mooncake::log::level, ::mooncake::log::subsys, __FILE__,    \
                          __LINE__)                                                     \
        .stream()
