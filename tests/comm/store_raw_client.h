// A raw TCP client of the rendezvous store (comm/store_wire.h), for tests that play a hostile
// peer: it can speak the handshake with any secret, send sealed or damaged frames, or say nothing.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <string>

#include "comm/store_wire.h"

namespace strata::test {

namespace wire = comm::detail::wire;

struct RawClient {
  int fd = -1;
  std::string session;
  uint64_t seq = 0;

  // Connects to address:port; false when refused.
  bool connect(const std::string& address, int port) {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, address.c_str(), &to.sin_addr);
    return ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0;
  }
  ~RawClient() {
    if (fd >= 0) ::close(fd);
  }

  void send(const std::string& data) { (void)!::send(fd, data.data(), data.size(), MSG_NOSIGNAL); }

  // Up to `size` bytes within `seconds`; fewer when the server closes first.
  std::string receive(size_t size, double seconds) {
    std::string got;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (got.size() < size) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      pollfd p{fd, POLLIN, 0};
      if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
      char buf[4096];
      const ssize_t n = ::recv(fd, buf, std::min(sizeof buf, size - got.size()), 0);
      if (n <= 0) break;
      got.append(buf, static_cast<size_t>(n));
    }
    return got;
  }

  // True when the server closes the connection within `seconds` (reads nothing else first).
  bool closed_within(double seconds) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      char buf[4096];
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n > 0) return false;  // the server answered something
      if (n == 0 || (errno != EINTR && errno != EAGAIN)) return true;  // EOF or a reset
    }
    return false;
  }

  // The handshake with `secret`: the server's hello, then our answer. Returns the server's proof
  // (empty when it closed instead).
  std::string handshake(const std::string& secret) {
    const std::string hello = receive(wire::kServerHello, 5);
    if (hello.size() != wire::kServerHello) return "";
    const std::string ns = hello.substr(sizeof wire::kMagic);
    const std::string nc(wire::kNonce, 'n');
    std::string answer(wire::kMagic, sizeof wire::kMagic);
    send(answer + nc + wire::client_proof(secret, ns, nc));
    session = wire::session_key(secret, ns, nc);
    return receive(wire::kServerProof, 5);
  }

  void send_request(const std::string& request) { send(wire::seal(session, 'C', seq++, request)); }

  static std::string set_request(const std::string& key, const std::string& value) {
    std::string r(1, 'S');
    wire::put_string(r, key);
    wire::put_string(r, value);
    return r;
  }
  static std::string get_request(const std::string& key) {
    std::string r(1, 'G');
    wire::put_string(r, key);
    return r;
  }
};

}  // namespace strata::test
