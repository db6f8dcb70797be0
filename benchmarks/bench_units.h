// Argument helpers of the benchmarks (te_bench, te_demo through te_common.h; store_put_profile,
// record_scan_bench): sizes with binary units, both ways, and comma lists. Header-only, no
// dependency on the engine or the store.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace mooncake::bench {

// "4K", "64k", "1.5M", "2G", "1GiB", "4096" -> bytes (binary units). Malformed input (a
// typo such as "4KB" or "1x") ends the program with status 2, naming it: a benchmark must
// not run a size the user did not ask for.
inline uint64_t parseSize(const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  int shift = -1;
  if (!s.empty() && end != s.c_str() && v >= 0 && v < 1e18) {
    const std::string unit(end);
    if (unit == "" || unit == "B" || unit == "b") shift = 0;
    if (unit == "K" || unit == "k" || unit == "KiB") shift = 10;
    if (unit == "M" || unit == "m" || unit == "MiB") shift = 20;
    if (unit == "G" || unit == "g" || unit == "GiB") shift = 30;
  }
  if (shift < 0) {
    std::fprintf(stderr, "bad size '%s' (want a number with K, M, G, KiB, MiB or GiB)\n",
                 s.c_str());
    std::exit(2);
  }
  return static_cast<uint64_t>(v * static_cast<double>(1ull << shift));
}

// Bytes in the largest binary unit that divides them: "2G", "64M", "4K", "100".
inline std::string fmtSize(uint64_t b) {
  char buf[32];
  if (b >= (1ull << 30) && b % (1ull << 30) == 0)
    std::snprintf(buf, sizeof buf, "%lluG", static_cast<unsigned long long>(b >> 30));
  else if (b >= (1ull << 20) && b % (1ull << 20) == 0)
    std::snprintf(buf, sizeof buf, "%lluM", static_cast<unsigned long long>(b >> 20));
  else if (b >= (1ull << 10) && b % (1ull << 10) == 0)
    std::snprintf(buf, sizeof buf, "%lluK", static_cast<unsigned long long>(b >> 10));
  else
    std::snprintf(buf, sizeof buf, "%llu", static_cast<unsigned long long>(b));
  return buf;
}

// "a,b,,c" -> {"a", "b", "c"} (empty items dropped).
inline std::vector<std::string> splitComma(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace mooncake::bench
