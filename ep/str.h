// ep::str(a, b, ...): the arguments streamed into one string (error messages of ep/*.cc).
#pragma once

#include <sstream>
#include <string>

namespace mooncake::ep {

template <typename... A>
std::string str(const A&... a) {
  std::ostringstream os;
  (os << ... << a);
  return os.str();
}

}  // namespace mooncake::ep
