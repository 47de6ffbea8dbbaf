#include "runtime/util/free_port.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <fstream>
#include <random>
#include <utility>
#include <vector>

namespace strata {
namespace {

// The kernel's ephemeral range; Linux's default when the file cannot be read.
std::pair<int, int> ephemeral_range() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  int lo = 32768, hi = 60999;
  if (!(in >> lo >> hi) || lo > hi) return {32768, 60999};
  return {lo, hi};
}

}  // namespace

int try_bind_port(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  int result = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    result = -errno;
  } else {
    socklen_t len = sizeof addr;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    result = ntohs(addr.sin_port);
  }
  ::close(fd);
  return result;
}

int pick_free_port() {
  // Candidates: 10000 up to the ephemeral range, and above it (below 10000 live well-known
  // services). Random, so that jobs started together rarely try the same ones.
  const auto [lo, hi] = ephemeral_range();
  std::vector<std::pair<int, int>> spans;
  if (lo > 10000) spans.emplace_back(10000, lo - 1);
  if (hi < 65535) spans.emplace_back(std::max(hi + 1, 10000), 65535);
  long total = 0;
  for (auto [a, b] : spans) total += b - a + 1;
  if (total > 0) {
    std::mt19937_64 rng(uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()) ^
                        (uint64_t(::getpid()) << 32));
    std::uniform_int_distribution<long> pick(0, total - 1);
    for (int attempt = 0; attempt < 256; ++attempt) {
      long k = pick(rng);
      int port = 0;
      for (auto [a, b] : spans) {
        if (k <= b - a) {
          port = int(a + k);
          break;
        }
        k -= b - a + 1;
      }
      if (try_bind_port(port) == port) return port;
    }
  }
  return try_bind_port(0);
}

}  // namespace strata
