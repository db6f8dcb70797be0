// The MC_* parameter registry: defaults, environment overrides, table hygiene, markdown.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include "engine/params.h"

namespace mooncake::params {
namespace {

// Sets an environment variable for the scope, restoring the previous state afterwards.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    // Reading the old value goes through the registry too (no getenv in C++ code).
    had_ = isSet(name);
    if (had_) old_ = getString(name);
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

const ParamDef* find(const char* name) {
  for (const auto& p : all())
    if (std::strcmp(p.name, name) == 0) return &p;
  return nullptr;
}

TEST(ParamsTest, TableIsWellFormed) {
  std::set<std::string> names;
  ASSERT_FALSE(all().empty());
  for (const auto& p : all()) {
    ASSERT_NE(p.name, nullptr);
    EXPECT_EQ(std::string(p.name).rfind("MC_", 0), 0u) << p.name << " lacks the MC_ prefix";
    EXPECT_TRUE(names.insert(p.name).second) << p.name << " is registered twice";
    ASSERT_NE(p.default_value, nullptr) << p.name;
    ASSERT_NE(p.doc, nullptr) << p.name;
    EXPECT_GT(std::strlen(p.doc), 10u) << p.name << " needs a one-line doc";
    if (p.type == Type::kInt) {
      char* end = nullptr;
      std::strtoll(p.default_value, &end, 0);
      EXPECT_TRUE(end != p.default_value && *end == '\0')
          << p.name << " default '" << p.default_value << "' is not an integer";
    }
  }
  for (const char* n : {"MC_TRANSPORT", "MC_SECRET", "MC_TCP_CONNS_PER_PEER", "MC_LOG_LEVEL"})
    EXPECT_NE(find(n), nullptr) << n << " is used by the engine and must be registered";
}

TEST(ParamsTest, IntDefaultAndOverride) {
  unsetenv("MC_INBOX_SLOTS");
  const ParamDef* p = find("MC_INBOX_SLOTS");
  ASSERT_NE(p, nullptr);
  EXPECT_FALSE(isSet("MC_INBOX_SLOTS"));
  EXPECT_EQ(getInt("MC_INBOX_SLOTS"), std::strtoll(p->default_value, nullptr, 0));
  {
    ScopedEnv e("MC_INBOX_SLOTS", "77");
    EXPECT_TRUE(isSet("MC_INBOX_SLOTS"));
    EXPECT_EQ(getInt("MC_INBOX_SLOTS"), 77);
  }
  {
    ScopedEnv e("MC_INBOX_SLOTS", "0x40");
    EXPECT_EQ(getInt("MC_INBOX_SLOTS"), 64);
  }
  {
    ScopedEnv e("MC_INBOX_SLOTS", "not-a-number");
    EXPECT_EQ(getInt("MC_INBOX_SLOTS"), std::strtoll(p->default_value, nullptr, 0))
        << "garbage falls back to the default";
  }
  EXPECT_FALSE(isSet("MC_INBOX_SLOTS"));
  {
    ScopedEnv e("MC_TCP_SLICE_BYTES", "12345678901");
    EXPECT_EQ(getInt("MC_TCP_SLICE_BYTES"), 12345678901LL) << "64-bit values";
  }
}

TEST(ParamsTest, StringAndBool) {
  unsetenv("MC_TRANSPORT");
  EXPECT_EQ(getString("MC_TRANSPORT"), find("MC_TRANSPORT")->default_value);
  {
    ScopedEnv e("MC_TRANSPORT", "tcp");
    EXPECT_EQ(getString("MC_TRANSPORT"), "tcp");
  }
  {
    ScopedEnv e("MC_TRANSPORT", "");
    EXPECT_TRUE(isSet("MC_TRANSPORT"));
    EXPECT_EQ(getString("MC_TRANSPORT"), "");
  }
  // getBool over any registered name: the accepted spellings of true.
  for (const char* t : {"1", "true", "yes", "on"}) {
    ScopedEnv e("MC_HOST_ID", t);
    EXPECT_TRUE(getBool("MC_HOST_ID")) << t;
  }
  for (const char* f : {"0", "false", "no", "off", ""}) {
    ScopedEnv e("MC_HOST_ID", f);
    EXPECT_FALSE(getBool("MC_HOST_ID")) << f;
  }
  {
    ScopedEnv e("MC_SPIN_US", "2.5");
    EXPECT_DOUBLE_EQ(getDouble("MC_SPIN_US"), 2.5);
  }
}

TEST(ParamsTest, MarkdownListsEveryParameter) {
  const std::string md = markdown();
  EXPECT_NE(md.find("| name |"), std::string::npos);
  for (const auto& p : all()) {
    EXPECT_NE(md.find(std::string("`") + p.name + "`"), std::string::npos) << p.name;
  }
}

TEST(ParamsDeathTest, UnknownNameAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(getInt("MC_NO_SUCH_PARAMETER"), "MC_NO_SUCH_PARAMETER");
  EXPECT_DEATH(getString("MC_ALSO_MISSING"), "not in the registry");
}

}  // namespace
}  // namespace mooncake::params
