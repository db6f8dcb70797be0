#include "engine/log.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "engine/params.h"

namespace mooncake::log {

namespace {

struct Config {
  int level = WARN;
  uint32_t mask = 0xffffffffu;
};

const char* kSubsysNames[] = {"ENGINE", "SHM", "TCP", "RDMA", "CUDA", "PG", "EP", "STORE"};

uint32_t parseMask(std::string s) {
  bool exclude = !s.empty() && s[0] == '^';
  if (exclude) s = s.substr(1);
  uint32_t m = 0;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    if (comma == std::string::npos) comma = s.size();
    std::string tok = s.substr(pos, comma - pos);
    if (tok == "ALL") m = 0xffffffffu;
    for (int i = 0; i < 8; ++i)
      if (tok == kSubsysNames[i]) m |= 1u << i;
    pos = comma + 1;
  }
  return exclude ? ~m : m;
}

const Config& config() {
  static const Config cfg = [] {
    Config c;
    std::string lv = params::getString("MC_LOG_LEVEL");
    const char* names[] = {"ERROR", "WARN", "INFO", "DEBUG", "TRACE"};
    for (int i = 0; i < 5; ++i)
      if (lv == names[i]) c.level = i;
    c.mask = parseMask(params::getString("MC_LOG_SUBSYS"));
    return c;
  }();
  return cfg;
}

const char* subsysName(Subsys s) {
  for (int i = 0; i < 8; ++i)
    if (s == (1u << i)) return kSubsysNames[i];
  return "?";
}

}  // namespace

bool enabled(Level level, Subsys subsys) {
  const Config& c = config();
  return level <= c.level && (c.mask & subsys) != 0;
}

void emit(Level level, Subsys subsys, const char* file, int line, const std::string& msg) {
  static std::mutex mu;
  static const char* lv[] = {"E", "W", "I", "D", "T"};
  const char* base = std::strrchr(file, '/');
  double t = std::chrono::duration<double>(
                 std::chrono::steady_clock::now().time_since_epoch()).count();
  std::lock_guard<std::mutex> g(mu);
  std::fprintf(stderr, "[mooncake %s %s pid %d %.6f %s:%d] %s\n", lv[level], subsysName(subsys),
               static_cast<int>(getpid()), t, base ? base + 1 : file, line, msg.c_str());
}

}  // namespace mooncake::log
