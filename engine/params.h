// THE registry of MC_* environment parameters. Every parameter the library reads is a row of
// the table in params.cc (name, type, default, one-line doc); nothing else calls getenv()
// (scripts, tests and benchmarks also read MC_TEST_BUILD_DIR, MC_MASTER_BIN and MC_PYTHON,
// which are not the library's).
// docs/env.md is generated from the table (`mc_params --markdown`) and a test checks it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mooncake::params {

enum class Type { kInt, kBool, kString, kDouble };

struct ParamDef {
  const char* name;
  Type type;
  const char* default_value;
  const char* doc;
};

// All registered parameters, in table order.
const std::vector<ParamDef>& all();

// Values are read from the environment at each call (set-up paths only, never a hot path),
// so a test may setenv() before creating an engine. Asking for a name that is not in the
// table aborts: it is a programming error, caught by any test that touches the code.
int64_t getInt(const char* name);
bool getBool(const char* name);
std::string getString(const char* name);
double getDouble(const char* name);

// A standard variable of the environment that is not ours (HOME, LD_LIBRARY_PATH): the one
// read of the environment outside the MC_* table, allowed for the names listed in params.cc
// only.
std::string getSystem(const char* name);

// True when the variable is set in the environment (not merely defaulted).
bool isSet(const char* name);

// Markdown table of every parameter (the content of docs/env.md).
std::string markdown();

}  // namespace mooncake::params
