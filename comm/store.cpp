#include "comm/store.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "comm/store_server.h"
#include "comm/store_wire.h"
#include "runtime/error.h"

namespace strata::comm::detail {
namespace {

using Clock = std::chrono::steady_clock;

enum class Io { Ok, Closed, Timeout, Failed };

// Waits for `events` on `fd` until `deadline`.
Io wait_fd(int fd, short events, Clock::time_point deadline) {
  while (true) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() < 0) return Io::Timeout;
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, int(std::min<int64_t>(left.count() + 1, 60000)));
    if (n > 0) return Io::Ok;
    if (n < 0 && errno != EINTR) return Io::Failed;
  }
}

Io read_exact(int fd, char* data, size_t size, Clock::time_point deadline) {
  while (size > 0) {
    const ssize_t n = ::recv(fd, data, size, 0);
    if (n > 0) {
      data += n, size -= size_t(n);
    } else if (n == 0) {
      return Io::Closed;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (Io w = wait_fd(fd, POLLIN, deadline); w != Io::Ok) return w;
    } else if (errno != EINTR) {
      return errno == ECONNRESET ? Io::Closed : Io::Failed;
    }
  }
  return Io::Ok;
}

Io write_all(int fd, const std::string& data, Clock::time_point deadline) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += size_t(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (Io w = wait_fd(fd, POLLOUT, deadline); w != Io::Ok) return w;
    } else if (n < 0 && errno != EINTR) {
      return errno == EPIPE || errno == ECONNRESET ? Io::Closed : Io::Failed;
    }
  }
  return Io::Ok;
}

// A connected non-blocking socket to host:port, or -1 with `error` set.
int connect_to(const std::string& host, int port, Clock::time_point deadline, std::string& error) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found)) {
    error = fmt::format("'{}' does not resolve ({})", host, ::gai_strerror(rc));
    return -1;
  }
  int fd = -1;
  for (addrinfo* a = found; a && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      // A connect that hangs (a firewall that drops packets) is bounded by the deadline.
      const Io w = wait_fd(fd, POLLOUT, std::min(deadline, Clock::now() + std::chrono::seconds(5)));
      int so_error = w == Io::Ok ? 0 : ETIMEDOUT;
      socklen_t length = sizeof so_error;
      if (w == Io::Ok) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &length);
      errno = so_error;
      rc = so_error == 0 ? 0 : -1;
    }
    if (rc != 0) {
      error = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  if (fd >= 0) {
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  return fd;
}

// The handshake of store_wire.h; "" when both sides proved the secret, else what went wrong.
// `busy`: the store closed the connection before this rank could answer (it evicts the oldest
// unauthenticated connections when too many authenticate at once): worth trying again.
std::string authenticate(int fd, const std::string& secret, Clock::time_point deadline,
                         std::string& session, bool& busy) {
  busy = false;
  char hello[wire::kServerHello];
  const Io greeted = read_exact(fd, hello, sizeof hello, deadline);
  if (greeted == Io::Closed) {
    busy = true;
    return "the store closed the connection before greeting it (too many connections "
           "authenticating at once: see rank 0's log for the peers it refused)";
  }
  if (greeted != Io::Ok || std::memcmp(hello, wire::kMagic, sizeof wire::kMagic) != 0)
    return "what answers there is not a Strata rendezvous store (another program on the port?)";
  const std::string ns(hello + sizeof wire::kMagic, wire::kNonce);
  const std::string nc = random_bytes(wire::kNonce);
  std::string answer(wire::kMagic, sizeof wire::kMagic);
  answer += nc;
  answer += wire::client_proof(secret, ns, nc);
  char proof[wire::kServerProof];
  if (const Io sent = write_all(fd, answer, deadline); sent == Io::Closed) {
    busy = true;
    return "the store closed the connection before this rank answered its greeting";
  } else if (sent != Io::Ok) {
    return "the store stopped taking this rank's answer to its greeting";
  }
  const Io proved = read_exact(fd, proof, sizeof proof, deadline);
  // A close without a word: the store evicted this connection before it read the answer (a
  // crowded store); a wrong secret is said (kWrongSecret).
  if (proved == Io::Closed) {
    busy = true;
    return "the store closed the connection before it read this rank's answer (too many "
           "connections authenticating at once: see rank 0's log for the peers it refused)";
  }
  if (proved != Io::Ok)
    return "the store did not answer this rank's proof of the job's secret in time";
  if (std::memcmp(proof, wire::kWrongSecret, sizeof proof) == 0)
    return "the store refused this rank: the ranks do not share one STRATA_JOB_SECRET (strata-run "
           "sets it on every rank; under SLURM or mpirun export the same value to every rank)";
  const std::string expected = wire::server_proof(secret, ns, nc);
  if (!equal_digests(reinterpret_cast<const uint8_t*>(proof),
                     reinterpret_cast<const uint8_t*>(expected.data())))
    return "the store there does not know this job's STRATA_JOB_SECRET (another job's store on "
           "MASTER_PORT?)";
  session = wire::session_key(secret, ns, nc);
  return "";
}

}  // namespace

struct Store::Impl {
  std::unique_ptr<StoreServer> server;  // rank 0 only; outlives the connection below
  std::chrono::milliseconds timeout{};
  std::mutex mu;  // one request at a time
  int fd = -1;
  std::string session;
  uint64_t send_seq = 0, recv_seq = 0;
  std::string broken;  // why the connection can no longer be used; "" while it can

  ~Impl() {
    if (fd >= 0) ::close(fd);
  }

  // Sends one request and returns the reply's payload; throws strata::Error.
  std::string call(const std::string& request) {
    std::lock_guard<std::mutex> lock(mu);
    if (!broken.empty()) throw Error(broken);
    const auto deadline = Clock::now() + timeout;
    auto fail = [&](const std::string& why) -> std::string {
      broken = "the connection was lost earlier: " + why;
      throw Error(why);
    };
    auto io = [&](Io r, const char* what) {
      if (r == Io::Timeout)
        fail(fmt::format("no {} within {:g} s", what, timeout.count() / 1000.0));
      if (r != Io::Ok) fail("the connection closed");
    };
    io(write_all(fd, wire::seal(session, 'C', send_seq++, request), deadline), "room to send");
    char header[wire::kHeader];
    io(read_exact(fd, header, sizeof header, deadline), "reply");
    const uint32_t length = wire::get_u32(header);
    if (length > wire::kMaxPayload) fail(fmt::format("a reply of {} bytes", length));
    std::string body(length + wire::kMac, '\0');
    io(read_exact(fd, body.data(), body.size(), deadline), "reply");
    const Digest mac = wire::frame_mac(session, 'S', recv_seq++, body.data(), length);
    if (!equal_digests(mac.data(), reinterpret_cast<const uint8_t*>(body.data()) + length))
      fail("a reply whose MAC is wrong (forged or damaged)");
    body.resize(length);
    if (!body.empty() && body[0] == '\1') {
      std::string text = body.substr(1);
      wire::Reader r(text);
      throw Error(r.str());
    }
    if (body.empty() || body[0] != '\0') fail("a malformed reply");
    return body.substr(1);
  }
};

namespace {

template <class F>
auto guarded(const Store& s, const char* op, const std::string& key, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    throw Error(fmt::format("rendezvous store at {}:{} failed on {}('{}'): {} (rank 0 serves the "
                            "store; it may have exited)",
                            s.host(), s.port(), op, key, e.what()));
  }
}

}  // namespace

Store::Store(std::unique_ptr<Impl> impl, std::string host, int port)
    : impl_(std::move(impl)), host_(std::move(host)), port_(port) {}
Store::~Store() = default;

std::unique_ptr<Store> Store::open(const std::string& host, int port, bool server,
                                   std::chrono::milliseconds timeout, const StoreAuth& auth) {
  auto impl = std::make_unique<Impl>();
  impl->timeout = timeout;
  if (server) {
    impl->server = std::make_unique<StoreServer>(
        host, port, StoreServerOptions{auth.secret, auth.listen_all, auth.auth_timeout});
    port = impl->server->port();
  }
  // A client retries until the deadline: rank 0 may not listen yet, or the store, crowded by
  // connections that do not authenticate (a flood of idle sockets), may close this one before it
  // could answer.
  const auto deadline = Clock::now() + timeout;
  std::string first_error;
  auto pause = std::chrono::milliseconds(5);
  while (true) {
    std::string error;
    const int fd = connect_to(host, port, deadline, error);
    if (fd >= 0) {
      const auto handshake = std::min(deadline, Clock::now() + auth.auth_timeout);
      bool busy = false;
      const std::string why = authenticate(fd, auth.secret, handshake, impl->session, busy);
      if (why.empty()) {
        impl->fd = fd;
        break;
      }
      ::close(fd);
      if (!busy || Clock::now() + pause >= deadline)
        throw Error(fmt::format("could not join the rendezvous store at {}:{}: {}", host, port,
                                why));
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(100));
      continue;
    }
    if (server)
      throw Error(fmt::format("rank 0 started the rendezvous store but cannot reach it at {}:{} "
                              "({})",
                              host, port, error));
    if (first_error.empty()) first_error = error;
    if (Clock::now() + pause >= deadline)
      throw Error(fmt::format("could not reach the rendezvous store at {}:{} within {:g} s: "
                              "rank 0 serves it, so rank 0 has not started, has died, or "
                              "MASTER_ADDR/MASTER_PORT are wrong ({}{})",
                              host, port, timeout.count() / 1000.0, first_error,
                              error == first_error ? "" : "; at the last try: " + error));
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(100));
  }
  return std::unique_ptr<Store>(new Store(std::move(impl), host, port));
}

void Store::set(const std::string& key, const std::string& value) {
  guarded(*this, "set", key, [&] {
    std::string request(1, 'S');
    wire::put_string(request, key);
    wire::put_string(request, value);
    impl_->call(request);
  });
}

std::string Store::get(const std::string& key) {
  return guarded(*this, "get", key, [&] {
    std::string request(1, 'G');
    wire::put_string(request, key);
    const std::string reply = impl_->call(request);
    wire::Reader r(reply);
    std::string value = r.str();
    if (!r.done()) throw Error("a malformed reply");
    return value;
  });
}

bool Store::check(const std::vector<std::string>& keys) {
  return guarded(*this, "check", keys.empty() ? "" : keys.front(), [&] {
    std::string request(1, 'C');
    wire::put_u32(request, uint32_t(keys.size()));
    for (const std::string& k : keys) wire::put_string(request, k);
    const std::string reply = impl_->call(request);
    if (reply.size() != 1) throw Error("a malformed reply");
    return reply[0] == 1;
  });
}

int64_t Store::add(const std::string& key, int64_t delta) {
  return guarded(*this, "add", key, [&] {
    std::string request(1, 'A');
    wire::put_string(request, key);
    wire::put_i64(request, delta);
    const std::string reply = impl_->call(request);
    wire::Reader r(reply);
    const int64_t now = r.i64();
    if (!r.done()) throw Error("a malformed reply");
    return now;
  });
}

bool Store::wait_for(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  // Polling keeps the connection free of long blocking requests and lets the caller name what
  // is missing.
  const auto deadline = Clock::now() + timeout;
  auto pause = std::chrono::milliseconds(1);
  while (true) {
    if (check(keys)) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
}

std::string loopback_name(const std::string& host) {
  in6_addr literal{};
  if (::inet_pton(AF_INET, host.c_str(), &literal) == 1 ||
      ::inet_pton(AF_INET6, host.c_str(), &literal) == 1)
    return "";
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return "";
  std::string first;
  bool all_loopback = found != nullptr;
  for (addrinfo* a = found; a; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = "";
    bool loop = false;
    if (a->ai_family == AF_INET) {
      const auto* v4 = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
      loop = (ntohl(v4->sin_addr.s_addr) >> 24) == 127;
      ::inet_ntop(AF_INET, &v4->sin_addr, text, sizeof text);
    } else if (a->ai_family == AF_INET6) {
      const auto* v6 = reinterpret_cast<const sockaddr_in6*>(a->ai_addr);
      loop = IN6_IS_ADDR_LOOPBACK(&v6->sin6_addr);
      ::inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof text);
    }
    all_loopback = all_loopback && loop;
    if (first.empty()) first = text;
  }
  ::freeaddrinfo(found);
  return all_loopback ? first : "";
}

}  // namespace strata::comm::detail
