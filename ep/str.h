// ep::str(a, b, ...): the arguments streamed into one string (error messages of ep/*.cc);
// ep::invalid(op, what): the std::invalid_argument of bad arguments ("op: what").
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace mooncake::ep {

template <typename... A>
std::string str(const A&... a) {
  std::ostringstream os;
  (os << ... << a);
  return os.str();
}

[[noreturn]] inline void invalid(const std::string& op, const std::string& what) {
  throw std::invalid_argument(op + ": " + what);
}

}  // namespace mooncake::ep
