// Prints the parameter registry: `mc_params --markdown` writes docs/env.md's content.
#include <cstdio>
#include <cstring>

#include "engine/params.h"

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--markdown") == 0) {
    std::fputs(mooncake::params::markdown().c_str(), stdout);
    return 0;
  }
  for (const auto& p : mooncake::params::all())
    std::printf("%s=%s\n", p.name, mooncake::params::getString(p.name).c_str());
  return 0;
}
