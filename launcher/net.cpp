#include "launcher/net.h"

#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "runtime/error.h"

namespace strata::launcher {
namespace {

// Binds a TCP socket on every address; returns the bound port, or -errno.
int try_bind(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  // SO_REUSEADDR: a port in TIME_WAIT is usable by the master; Linux still refuses a listener's.
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

}  // namespace

std::string this_hostname() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

bool is_local_host(const std::string& host) {
  if (host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0) return true;
  const std::string me = this_hostname();
  auto short_name = [](const std::string& h) { return h.substr(0, h.find('.')); };
  return host == me || host == short_name(me);
}

void check_port_free(int port) {
  if (port > 65535) throw Error(fmt::format("master port {} is not a TCP port (1-65535)", port));
  int result = try_bind(port);
  if (result < 0)
    throw Error(
        fmt::format("master port {} is not free on this host ({}); choose another "
                    "--master-port, or leave it out to pick a free one",
                    port, std::strerror(-result)));
}

int pick_free_port() {
  int port = try_bind(0);
  if (port <= 0) throw Error(fmt::format("cannot find a free TCP port: {}", std::strerror(-port)));
  return port;
}

}  // namespace strata::launcher
