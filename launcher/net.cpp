#include "launcher/net.h"

#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "runtime/error.h"
#include "runtime/util/free_port.h"

namespace strata::launcher {

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
  int result = try_bind_port(port);
  if (result < 0)
    throw Error(
        fmt::format("master port {} is not free on this host ({}); choose another "
                    "--master-port, or leave it out to pick a free one",
                    port, std::strerror(-result)));
}

int pick_free_port() {
  int port = strata::pick_free_port();
  if (port <= 0) throw Error(fmt::format("cannot find a free TCP port: {}", std::strerror(-port)));
  return port;
}

}  // namespace strata::launcher
