// The handle Python holds on a transfer engine (mooncake._C.InnerTransferEngine, what upstream's
// TransferEngine.get_engine() returns), and the process-wide engine settings that
// mooncake.pg.set_transfer_engine() / set_host_ip() make for the groups created afterwards.
#pragma once

#include <memory>
#include <string>

#include "engine/engine.h"

namespace mooncake::torch_ext {

struct EngineHandle {
  std::shared_ptr<engine::TransferEngine> engine;
};

// The engine that sharedEngine() (process_group.h) hands to every group created from now on
// instead of creating its own; nullptr: create one as usual.
void setSharedEngineOverride(std::shared_ptr<engine::TransferEngine> engine);
std::shared_ptr<engine::TransferEngine> sharedEngineOverride();
// The address (EngineOptions.host) of the engine sharedEngine() creates next; "" = its default.
void setSharedEngineHost(const std::string& host);
std::string sharedEngineHost();

}  // namespace mooncake::torch_ext
