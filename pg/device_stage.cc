#include "pg/device_stage.h"

#include <string>

#include "engine/device/device.h"
#include "pg/communicator.h"

namespace mooncake::pg {

namespace {
constexpr int64_t kCopyMs = 60000;

void copyOrThrow(void* dst, const void* src, size_t n, const char* op, const char* what) {
  Status st = engine::device::copyAny(dst, src, n, engine::deadlineInMs(kCopyMs));
  if (!st.ok())
    throw CommError(std::string("mooncake pg: ") + op + ": copying " + std::to_string(n) +
                        " bytes " + what + " GPU memory failed: " + st.toString(),
                    -1, op);
}
}  // namespace

bool DeviceStage::any(std::initializer_list<const void*> ps) {
  if (!engine::device::active()) return false;
  for (const void* p : ps)
    if (p != nullptr && engine::device::isDeviceMemory(p)) return true;
  return false;
}

void DeviceStage::in(const void* src, size_t n, size_t at) {
  copyOrThrow(buf_.data() + at, src, n, op_, "out of");
}

void DeviceStage::out(void* dst, size_t n, size_t at) {
  copyOrThrow(dst, buf_.data() + at, n, op_, "into");
}

void DeviceCopies::add(void* dst, const void* src, size_t n) {
  if (n == 0) return;
  auto layer = engine::device::get();
  Status st = layer.status();
  if (st.ok()) {
    if (ordinal_ < 0) {
      engine::device::PointerInfo a = (*layer)->pointer(dst), b = (*layer)->pointer(src);
      ordinal_ = a.device ? a.ordinal : b.device ? b.ordinal : 0;
    }
    st = (*layer)->copyAsync(dst, src, n, ordinal_);
  }
  if (!st.ok())
    throw CommError(std::string("mooncake pg: ") + op_ + ": queueing a copy of " +
                        std::to_string(n) + " bytes of GPU memory failed: " + st.toString(),
                    -1, op_);
  pending_ = true;
}

void DeviceCopies::wait() {
  if (!pending_) return;
  pending_ = false;
  auto layer = engine::device::get();
  Status st = layer.status();
  if (st.ok()) {
    auto ev = (*layer)->record(ordinal_);
    st = ev.ok() ? (*ev)->wait(engine::deadlineInMs(kCopyMs)) : ev.status();
  }
  if (!st.ok())
    throw CommError(std::string("mooncake pg: ") + op_ + ": copying GPU memory failed: " +
                        st.toString(),
                    -1, op_);
}

}  // namespace mooncake::pg
