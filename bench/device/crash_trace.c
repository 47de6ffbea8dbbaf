// LD_PRELOAD diagnostic for the device (bench/device/call_trace.sh): on SIGSEGV, SIGBUS or SIGABRT
// print the faulting address, the thread and a backtrace (frames as binary(+offset)), then die.
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
static void handler(int sig, siginfo_t* info, void* ctx) {
  (void)ctx;
  char line[160];
  int n = snprintf(line, sizeof line, "\n*** signal %d at address %p, thread %ld ***\n", sig,
                   info->si_addr, (long)syscall(SYS_gettid));
  write(2, line, n);
  void* frames[80];
  int count = backtrace(frames, 80);
  backtrace_symbols_fd(frames, count, 2);
  FILE* maps = fopen("/proc/self/maps", "r");
  if (maps) {
    char buf[512];
    while (fgets(buf, sizeof buf, maps))
      if (strstr(buf, "r-xp")) write(2, buf, strlen(buf));
    fclose(maps);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}
__attribute__((constructor)) static void install(void) {
  static char stack[1 << 16];
  stack_t ss = {.ss_sp = stack, .ss_size = sizeof stack, .ss_flags = 0};
  sigaltstack(&ss, NULL);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = handler;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
  sigaction(SIGABRT, &sa, NULL);
}
