#include "store/master/master_params.h"

#include "engine/params.h"

namespace mooncake::store {

MasterConfig masterConfigFromParams() {
  namespace p = ::mooncake::params;
  auto nonneg = [](int64_t v) { return v < 0 ? uint64_t{0} : static_cast<uint64_t>(v); };
  MasterConfig c;
  c.lease_ttl_ms = nonneg(p::getInt("MC_STORE_LEASE_TTL_MS"));
  c.soft_pin_ttl_ms = nonneg(p::getInt("MC_STORE_SOFT_PIN_TTL_MS"));
  c.eviction_high_watermark = p::getDouble("MC_STORE_EVICTION_HIGH_WATERMARK");
  c.eviction_ratio = p::getDouble("MC_STORE_EVICTION_RATIO");
  c.client_ttl_ms = nonneg(p::getInt("MC_STORE_CLIENT_TTL_S")) * 1000;
  c.put_discard_timeout_ms = nonneg(p::getInt("MC_STORE_PUT_DISCARD_TIMEOUT_S")) * 1000;
  c.put_release_timeout_ms = nonneg(p::getInt("MC_STORE_PUT_RELEASE_TIMEOUT_S")) * 1000;
  return c;
}

}  // namespace mooncake::store
