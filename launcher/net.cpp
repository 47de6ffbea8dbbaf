#include "launcher/net.h"

#include <fmt/format.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/random.h>
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
  if (host.find('@') != std::string::npos) return false;
  if (is_loopback(host)) return true;
  const std::string me = this_hostname();
  auto short_name = [](const std::string& h) { return h.substr(0, h.find('.')); };
  return host == me || host == short_name(me);
}

bool is_loopback(const std::string& address) {
  return address == "localhost" || address == "::1" || address.rfind("127.", 0) == 0 ||
         address.rfind("::ffff:127.", 0) == 0;
}

namespace {

struct Addresses {
  addrinfo* list = nullptr;
  int error = 0;
  explicit Addresses(const std::string& host, int socktype) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = socktype;
    error = ::getaddrinfo(host.c_str(), "9", &hints, &list);  // any port: only the address counts
  }
  ~Addresses() {
    if (list) ::freeaddrinfo(list);
  }
};

std::string numeric(const sockaddr* address, socklen_t length) {
  char text[NI_MAXHOST] = {};
  if (::getnameinfo(address, length, text, sizeof text, nullptr, 0, NI_NUMERICHOST) != 0) return "";
  return text;
}

}  // namespace

std::string address_towards(const std::string& host) {
  Addresses found(host, SOCK_DGRAM);
  for (addrinfo* a = found.error ? nullptr : found.list; a; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t length = sizeof local;
    std::string address;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0)
      address = numeric(reinterpret_cast<sockaddr*>(&local), length);
    ::close(fd);
    if (!address.empty()) return address;
  }
  return "";
}

std::string resolve_error(const std::string& host) {
  Addresses found(host, SOCK_STREAM);
  return found.error == 0 ? "" : ::gai_strerror(found.error);
}

bool names_this_machine(const std::string& host) {
  Addresses found(host, SOCK_STREAM);
  for (addrinfo* a = found.error ? nullptr : found.list; a; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage any_port{};
    std::memcpy(&any_port, a->ai_addr, a->ai_addrlen);
    if (a->ai_family == AF_INET) reinterpret_cast<sockaddr_in*>(&any_port)->sin_port = 0;
    if (a->ai_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&any_port)->sin6_port = 0;
    const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&any_port), a->ai_addrlen) == 0;
    ::close(fd);
    if (bound) return true;
  }
  return false;
}

std::string loopback_alias(const std::string& host) {
  in6_addr literal{};
  if (::inet_pton(AF_INET, host.c_str(), &literal) == 1 ||
      ::inet_pton(AF_INET6, host.c_str(), &literal) == 1)
    return "";
  Addresses found(host, SOCK_STREAM);
  std::string first;
  for (addrinfo* a = found.error ? nullptr : found.list; a; a = a->ai_next) {
    const std::string address = numeric(a->ai_addr, a->ai_addrlen);
    if (!is_loopback(address)) return "";
    if (first.empty()) first = address;
  }
  return first;
}

std::string make_job_secret() {
  unsigned char bytes[32];
  size_t got = 0;
  while (got < sizeof bytes) {
    const ssize_t n = ::getrandom(bytes + got, sizeof bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      throw Error(fmt::format("cannot make the job's secret (getrandom: {}); set "
                              "STRATA_JOB_SECRET yourself",
                              std::strerror(errno)));
    got += static_cast<size_t>(n);
  }
  static const char* digits = "0123456789abcdef";
  std::string hex;
  for (unsigned char b : bytes) hex += {digits[b >> 4], digits[b & 15]};
  return hex;
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
