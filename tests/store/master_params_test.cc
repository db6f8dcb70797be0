// MC_STORE_* parameters reach MasterConfig; defaults match Mooncake Store's.
#include "store/master/master_params.h"

#include <gtest/gtest.h>

#include <cstdlib>

#include "engine/params.h"

namespace mooncake::store {
namespace {

const char* const kStoreParams[] = {
    "MC_STORE_LEASE_TTL_MS",
    "MC_STORE_SOFT_PIN_TTL_MS",
    "MC_STORE_EVICTION_HIGH_WATERMARK",
    "MC_STORE_EVICTION_RATIO",
    "MC_STORE_CLIENT_TTL_S",
    "MC_STORE_PUT_DISCARD_TIMEOUT_S",
    "MC_STORE_PUT_RELEASE_TIMEOUT_S",
};

class ParamsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* n : kStoreParams) unsetenv(n);
  }
  void TearDown() override { SetUp(); }
};

TEST_F(ParamsTest, DefaultsMatchMooncake) {
  MasterConfig c = masterConfigFromParams();
  EXPECT_EQ(c.lease_ttl_ms, 5000u);
  EXPECT_EQ(c.soft_pin_ttl_ms, 30u * 60 * 1000);
  EXPECT_DOUBLE_EQ(c.eviction_high_watermark, 0.95);
  EXPECT_DOUBLE_EQ(c.eviction_ratio, 0.05);
  EXPECT_EQ(c.client_ttl_ms, 10000u);
  EXPECT_EQ(c.put_discard_timeout_ms, 30000u);
  EXPECT_EQ(c.put_release_timeout_ms, 600000u);
  // The struct's own defaults agree with the registry's.
  MasterConfig d;
  EXPECT_EQ(d.lease_ttl_ms, c.lease_ttl_ms);
  EXPECT_EQ(d.client_ttl_ms, c.client_ttl_ms);
  EXPECT_DOUBLE_EQ(d.eviction_high_watermark, c.eviction_high_watermark);
}

TEST_F(ParamsTest, EnvironmentOverrides) {
  setenv("MC_STORE_LEASE_TTL_MS", "250", 1);
  setenv("MC_STORE_EVICTION_HIGH_WATERMARK", "0.8", 1);
  setenv("MC_STORE_EVICTION_RATIO", "0.2", 1);
  setenv("MC_STORE_CLIENT_TTL_S", "3", 1);
  MasterConfig c = masterConfigFromParams();
  EXPECT_EQ(c.lease_ttl_ms, 250u);
  EXPECT_DOUBLE_EQ(c.eviction_high_watermark, 0.8);
  EXPECT_DOUBLE_EQ(c.eviction_ratio, 0.2);
  EXPECT_EQ(c.client_ttl_ms, 3000u);
  setenv("MC_STORE_LEASE_TTL_MS", "-5", 1);
  EXPECT_EQ(masterConfigFromParams().lease_ttl_ms, 0u) << "negative clamps to 0";
}

TEST_F(ParamsTest, EveryStoreParameterIsRegistered) {
  for (const char* n : kStoreParams) {
    bool found = false;
    for (const auto& p : params::all()) found = found || std::string(p.name) == n;
    EXPECT_TRUE(found) << n;
  }
}

}  // namespace
}  // namespace mooncake::store
