// Capabilities in tests: the emulator's and the rdma transport's registration tests need a
// thread without CAP_IPC_LOCK (they run as root) to meet RLIMIT_MEMLOCK as a user would.
#pragma once

#include <linux/capability.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace mooncake::test {

// Sets or clears CAP_IPC_LOCK in the calling thread's effective set (capabilities are per
// thread): false when it cannot (setting it when it is not in the permitted set).
inline bool setIpcLock(bool on) {
  __user_cap_header_struct h{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct d[2] = {};
  if (syscall(SYS_capget, &h, d) != 0) return false;
  const uint32_t bit = 1u << (CAP_IPC_LOCK % 32);
  if (on && !(d[CAP_IPC_LOCK / 32].permitted & bit)) return false;
  if (on)
    d[CAP_IPC_LOCK / 32].effective |= bit;
  else
    d[CAP_IPC_LOCK / 32].effective &= ~bit;
  return syscall(SYS_capset, &h, d) == 0;
}

}  // namespace mooncake::test
