#include "runtime/log.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace strata::log {
namespace {

std::mutex mutex;
bool status_active = false;
bool quiet = false;

bool stdout_is_terminal() {
  static const bool tty = isatty(fileno(stdout)) != 0;
  return tty;
}

}  // namespace

void set_rank(int rank) {
  const char* all = std::getenv("STRATA_LOG_ALL_RANKS");
  std::lock_guard<std::mutex> lock(mutex);
  quiet = rank != 0 && !(all != nullptr && std::strcmp(all, "1") == 0);
}

void line(const std::string& text) {
  std::lock_guard<std::mutex> lock(mutex);
  if (quiet) return;
  if (status_active) std::fputs("\r\033[K", stdout);
  std::fputs(text.c_str(), stdout);
  std::fputc('\n', stdout);
  if (status_active && stdout_is_terminal()) status_active = false;
  std::fflush(stdout);
}

void status(const std::string& text) {
  std::lock_guard<std::mutex> lock(mutex);
  if (quiet) return;
  if (stdout_is_terminal()) {
    std::fputs("\r\033[K", stdout);
    std::fputs(text.c_str(), stdout);
    status_active = true;
  } else {
    std::fputs(text.c_str(), stdout);
    std::fputc('\n', stdout);
  }
  std::fflush(stdout);
}

void end_status() {
  std::lock_guard<std::mutex> lock(mutex);
  if (status_active) std::fputc('\n', stdout);
  status_active = false;
  std::fflush(stdout);
}

}  // namespace strata::log
