#include "torch_ext/csrc/store_rendezvous.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <thread>
#include <vector>

namespace mooncake::torch_ext {
namespace {

// A store failure (master gone, socket broken) is not the caller's fault: kUnavailable.
Status storeError(const char* what, const std::string& key, const std::exception& e) {
  return MC_STATUS(kUnavailable, "c10d store " << what << "('" << key << "') failed: " << e.what());
}

}  // namespace

Status StoreRendezvous::set(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lk(mu_);
  try {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  } catch (const std::exception& e) {
    return storeError("set", key, e);
  }
  return Status::OK();
}

Result<std::string> StoreRendezvous::get(const std::string& key) {
  std::lock_guard<std::mutex> lk(mu_);
  try {
    // c10d's get() blocks until the key exists; the Rendezvous contract says NotFound.
    if (!store_->check({key})) return MC_STATUS(kNotFound, "rendezvous key '" << key << "' absent");
    std::vector<uint8_t> v = store_->get(key);
    return std::string(v.begin(), v.end());
  } catch (const std::exception& e) {
    return storeError("get", key, e);
  }
}

Result<std::string> StoreRendezvous::wait(const std::string& key, engine::Deadline deadline) {
  auto sleep = std::chrono::microseconds(200);
  const auto start = engine::Clock::now();
  for (;;) {
    Result<std::string> r = get(key);
    if (r.ok() || r.status().code() != Code::kNotFound) return r;
    const auto now = engine::Clock::now();
    if (now >= deadline) {
      return MC_STATUS(
          kTimeout,
          "rendezvous key '"
              << key << "' did not appear within "
              << std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count()
              << " ms");
    }
    std::this_thread::sleep_for(std::min<engine::Clock::duration>(sleep, deadline - now));
    sleep = std::min<std::chrono::microseconds>(sleep * 2, std::chrono::milliseconds(20));
  }
}

Result<int64_t> StoreRendezvous::add(const std::string& key, int64_t delta) {
  std::lock_guard<std::mutex> lk(mu_);
  try {
    return store_->add(key, delta);
  } catch (const std::exception& e) {
    return storeError("add", key, e);
  }
}

}  // namespace mooncake::torch_ext
