// Preloaded (LD_PRELOAD) into scripts/gpu_check.sh's torch check: on SIGSEGV, SIGBUS, SIGFPE,
// SIGILL or SIGABRT it writes the native stack (execinfo) to stderr, marked "native backtrace",
// before the default action; the script then names the module's frames with addr2line. On
// SIGUSR2 it writes the stack of the thread the signal was sent to and goes on: the torch
// check sends it to every thread of a rank that hangs (tgkill) before killing it. A GPU
// session has minutes of device time: a crash or a hang must explain itself in the run that hit it.
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void onFatal(int sig) {
  void* frames[64];
  int n = backtrace(frames, 64);
  static const char kMark[] = "native backtrace (signal ";
  char num[4] = {(char)('0' + sig / 10), (char)('0' + sig % 10), ')', '\n'};
  (void)!write(2, kMark, sizeof kMark - 1);
  (void)!write(2, num, sizeof num);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

static void onDump(int sig) {
  (void)sig;
  void* frames[64];
  int n = backtrace(frames, 64);
  static const char kMark[] = "native backtrace (SIGUSR2, one thread)\n";
  (void)!write(2, kMark, sizeof kMark - 1);
  backtrace_symbols_fd(frames, n, 2);
}

__attribute__((constructor)) static void installCrashBacktrace(void) {
  void* warm[1];
  backtrace(warm, 1);  // (loads libgcc's unwinder now, not inside the handler)
  const int sigs[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
  for (unsigned i = 0; i < sizeof sigs / sizeof sigs[0]; ++i) signal(sigs[i], onFatal);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = onDump;
  sa.sa_flags = SA_RESTART;
  sigaction(SIGUSR2, &sa, NULL);
}
