#include "torch_ext/csrc/engine_handle.h"

#include <mutex>

namespace mooncake::torch_ext {
namespace {
std::mutex mu;
std::shared_ptr<engine::TransferEngine> override_engine;  // guarded by mu
std::string host;                                          // guarded by mu
}  // namespace

void setSharedEngineOverride(std::shared_ptr<engine::TransferEngine> engine) {
  std::lock_guard<std::mutex> g(mu);
  override_engine = std::move(engine);
}

std::shared_ptr<engine::TransferEngine> sharedEngineOverride() {
  std::lock_guard<std::mutex> g(mu);
  return override_engine;
}

void setSharedEngineHost(const std::string& h) {
  std::lock_guard<std::mutex> g(mu);
  host = h;
}

std::string sharedEngineHost() {
  std::lock_guard<std::mutex> g(mu);
  return host;
}

}  // namespace mooncake::torch_ext
