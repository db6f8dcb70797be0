// MasterConfig from the MC_STORE_* parameters of the registry (engine/params.cc).
// Separate from the master library so that the metadata logic builds and tests without the
// engine; linking this needs mooncake_engine (target mooncake_store_master_params).
#pragma once

#include "store/master/master_types.h"

namespace mooncake::store {

// Defaults of MasterConfig overridden by whatever MC_STORE_* variables are set.
MasterConfig masterConfigFromParams();

}  // namespace mooncake::store
