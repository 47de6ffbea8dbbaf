#include "comm/store_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <list>
#include <map>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "comm/store_wire.h"
#include "runtime/error.h"

namespace strata::comm::detail {
namespace {

using Clock = std::chrono::steady_clock;
// Unauthenticated connections at once. Past that a new one evicts the oldest that has sent
// nothing (a rank answers the greeting at once, so the oldest silent one is not a rank's): a
// peer holding idle sockets can no longer keep the ranks out, it only keeps recycling its own.
// No cap per source address: the job's ranks often share one (127.0.0.1 on one machine).
constexpr size_t kMaxPending = 256;
// Refusals named one by one, then counted: one line per kSummaryEvery (a flood of idle sockets
// must not flood rank 0's log).
constexpr uint64_t kNamedRefusals = 20;
constexpr auto kSummaryEvery = std::chrono::seconds(10);

std::string address_of(const sockaddr_storage& a) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (a.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&a);
    ::inet_ntop(AF_INET, &v4->sin_addr, host, sizeof host);
    port = ntohs(v4->sin_port);
    return fmt::format("{}:{}", host, port);
  }
  const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&a);
  ::inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof host);
  return fmt::format("[{}]:{}", host, ntohs(v6->sin6_port));
}

struct Conn {
  int fd = -1;
  std::string peer;
  bool authed = false;
  Clock::time_point deadline;
  std::string ns;   // the nonce sent to it
  std::string key;  // the session key, once authenticated
  uint64_t recv_seq = 0, send_seq = 0;
  std::string in, out;
  std::string waiting;  // the key of a pending get; "" when none
  bool has_waiting = false;
};

}  // namespace

struct StoreServer::Impl {
  StoreServerOptions options;
  int listen_fd = -1;
  int wake[2] = {-1, -1};
  int port = 0;
  std::list<Conn> conns;
  std::map<std::string, std::string> data;
  std::thread thread;
  uint64_t refused = 0, summarized = 0;
  Clock::time_point last_summary;

  void say(const std::string& text) {
    std::fprintf(stderr, "strata: rendezvous store: %s\n", text.c_str());
  }

  // A connection refused before it authenticated: named while few, then counted (a line per
  // kSummaryEvery at most, said when the next refusal comes after it).
  void refuse(const std::string& peer, const std::string& why) {
    ++refused;
    if (refused <= kNamedRefusals) {
      say(fmt::format("refused {}: {} ({} refused so far; the job goes on)", peer, why, refused));
      if (refused == kNamedRefusals)
        say(fmt::format("further refusals are counted, a line per {} s at most",
                        kSummaryEvery.count()));
      summarized = refused;
      last_summary = Clock::now();
      return;
    }
    const auto now = Clock::now();
    if (now - last_summary < kSummaryEvery) return;
    say(fmt::format("refused {} more connection(s) in the last {:.0f} s, the last {}: {} ({} "
                    "refused so far; the job goes on)",
                    refused - summarized,
                    std::chrono::duration<double>(now - last_summary).count(), peer, why,
                    refused));
    summarized = refused;
    last_summary = now;
  }

  // Closes `c` and says why (refusals are rate-limited; a client's own goodbye is silent).
  void drop(std::list<Conn>::iterator c, const std::string& why) {
    if (!why.empty()) {
      if (!c->authed) {
        refuse(c->peer, why);
      } else {
        say(fmt::format("dropped the connection from {}: {} (the job goes on)", c->peer, why));
      }
    }
    ::close(c->fd);
    conns.erase(c);
  }

  void accept_all() {
    while (true) {
      sockaddr_storage from{};
      socklen_t length = sizeof from;
      const int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&from), &length,
                               SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN, or a connection reset before we took it
      const size_t pending = size_t(std::count_if(conns.begin(), conns.end(),
                                                  [](const Conn& c) { return !c.authed; }));
      if (pending >= kMaxPending) evict_oldest();
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      Conn c;
      c.fd = fd;
      c.peer = address_of(from);
      c.deadline = Clock::now() + options.auth_timeout;
      c.ns = random_bytes(wire::kNonce);
      c.out.assign(wire::kMagic, sizeof wire::kMagic);
      c.out += c.ns;
      conns.push_back(std::move(c));
    }
  }

  // Makes room for a new connection: the oldest unauthenticated one that has sent nothing (the
  // list is in accept order), else the oldest unauthenticated one. "Sent nothing" looks into the
  // socket too: a rank's answer may have arrived since the last poll, and evicting it then would
  // close a rank that did everything right.
  void evict_oldest() {
    auto victim = conns.end();
    for (auto c = conns.begin(); c != conns.end(); ++c) {
      if (c->authed) continue;
      if (victim == conns.end()) victim = c;
      char byte;
      if (c->in.empty() && ::recv(c->fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) <= 0) {
        victim = c;
        break;
      }
    }
    if (victim != conns.end())
      drop(victim, fmt::format("evicted, {} connections were authenticating (the oldest silent "
                               "one makes room for the newest)",
                               kMaxPending));
  }

  void send(Conn& c, const std::string& payload) {
    c.out += wire::seal(c.key, 'S', c.send_seq++, payload);
  }

  // Answers the gets waiting for `key`.
  void wake_waiters(const std::string& key) {
    for (Conn& c : conns)
      if (c.has_waiting && c.waiting == key) {
        c.has_waiting = false;
        std::string reply(1, '\0');
        wire::put_string(reply, data[key]);
        send(c, reply);
      }
  }

  // One request; "" when served, else why the connection is dropped.
  std::string serve(Conn& c, const std::string& request) {
    wire::Reader r(request);
    const char op = char(r.u8());
    std::string reply(1, '\0');
    if (op == 'S') {
      std::string key = r.str(), value = r.str();
      if (!r.done()) return "a malformed set";
      data[key] = std::move(value);
      send(c, reply);
      wake_waiters(key);
    } else if (op == 'G') {
      std::string key = r.str();
      if (!r.done()) return "a malformed get";
      auto it = data.find(key);
      if (it == data.end()) {
        c.has_waiting = true;
        c.waiting = std::move(key);
        return "";
      }
      wire::put_string(reply, it->second);
      send(c, reply);
    } else if (op == 'A') {
      std::string key = r.str();
      const int64_t delta = r.i64();
      if (!r.done()) return "a malformed add";
      std::string& value = data[key];
      int64_t now = 0;
      if (!value.empty()) {
        char* end = nullptr;
        errno = 0;
        now = std::strtoll(value.c_str(), &end, 10);
        if (errno != 0 || *end != '\0') {
          std::string error(1, '\1');
          wire::put_string(error, fmt::format("add on key '{}', whose value is not a number", key));
          send(c, error);
          return "";
        }
      }
      now += delta;
      value = std::to_string(now);
      wire::put_i64(reply, now);
      send(c, reply);
      wake_waiters(key);
    } else if (op == 'C') {
      const uint32_t n = r.u32();
      bool all = true;
      for (uint32_t i = 0; i < n && !r.bad(); ++i) all = data.count(r.str()) && all;
      if (!r.done()) return "a malformed check";
      reply += char(all ? 1 : 0);
      send(c, reply);
    } else {
      return fmt::format("an unknown request ({})", int(uint8_t(op)));
    }
    return "";
  }

  // What arrived on `c`; "" while all is well, else why it is dropped.
  std::string take_input(Conn& c) {
    if (!c.authed) {
      if (std::memcmp(c.in.data(), wire::kMagic, std::min(c.in.size(), sizeof wire::kMagic)))
        return "it does not speak the store's protocol";
      if (c.in.size() < wire::kClientAnswer) return "";
      if (c.in.size() > wire::kClientAnswer) return "it sent more than the handshake allows";
      const std::string nc = c.in.substr(sizeof wire::kMagic, wire::kNonce);
      const std::string proof = wire::client_proof(options.secret, c.ns, nc);
      if (!equal_digests(reinterpret_cast<const uint8_t*>(proof.data()),
                         reinterpret_cast<const uint8_t*>(c.in.data()) + sizeof wire::kMagic +
                             wire::kNonce))
      {
        // Said before the close (best effort: a fresh socket has room for 32 bytes), so the
        // client does not take the close for a crowded store and try again.
        (void)!::send(c.fd, wire::kWrongSecret, wire::kServerProof, MSG_NOSIGNAL | MSG_DONTWAIT);
        return "it does not know the job's secret (STRATA_JOB_SECRET)";
      }
      c.authed = true;
      c.key = wire::session_key(options.secret, c.ns, nc);
      c.out += wire::server_proof(options.secret, c.ns, nc);
      c.in.clear();
      return "";
    }
    while (!c.has_waiting && c.in.size() >= wire::kHeader) {
      const uint32_t length = wire::get_u32(c.in.data());
      if (length > wire::kMaxPayload)
        return fmt::format("a message of {} bytes, over the limit of {}", length,
                           wire::kMaxPayload);
      const size_t whole = wire::kHeader + length + wire::kMac;
      if (c.in.size() < whole) return "";
      const Digest mac = wire::frame_mac(c.key, 'C', c.recv_seq, c.in.data() + wire::kHeader,
                                         length);
      if (!equal_digests(mac.data(),
                         reinterpret_cast<const uint8_t*>(c.in.data()) + wire::kHeader + length))
        return "a message whose MAC is wrong (forged, replayed or damaged)";
      ++c.recv_seq;
      const std::string request = c.in.substr(wire::kHeader, length);
      c.in.erase(0, whole);
      if (std::string why = serve(c, request); !why.empty()) return why;
    }
    return "";
  }

  // Reads what `c` has; false (after dropping it) when it is gone.
  bool read_from(std::list<Conn>::iterator c) {
    char buf[65536];
    while (true) {
      // Before authentication, read no more than the handshake answer and one byte.
      const size_t room = c->authed ? sizeof buf : wire::kClientAnswer + 1 - c->in.size();
      const ssize_t n = ::recv(c->fd, buf, std::min(room, sizeof buf), 0);
      if (n > 0) {
        c->in.append(buf, size_t(n));
        if (std::string why = take_input(*c); !why.empty()) return drop(c, why), false;
        if (!c->authed && c->in.size() >= wire::kClientAnswer) return true;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      drop(c, c->authed ? "" : "it closed the connection before authenticating");
      return false;
    }
  }

  bool write_to(std::list<Conn>::iterator c) {
    while (!c->out.empty()) {
      const ssize_t n = ::send(c->fd, c->out.data(), c->out.size(), MSG_NOSIGNAL);
      if (n > 0) {
        c->out.erase(0, size_t(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      drop(c, c->authed ? "" : "the connection failed before authenticating");
      return false;
    }
    if (c->out.size() > 4 * size_t(wire::kMaxPayload))
      return drop(c, "it does not read its replies"), false;
    return true;
  }

  void loop() {
    std::vector<pollfd> fds;
    std::vector<std::list<Conn>::iterator> which;
    while (true) {
      fds.assign({{wake[0], POLLIN, 0}, {listen_fd, POLLIN, 0}});
      which.clear();
      auto next = Clock::time_point::max();
      for (auto c = conns.begin(); c != conns.end(); ++c) {
        fds.push_back({c->fd, short(POLLIN | (c->out.empty() ? 0 : POLLOUT)), 0});
        which.push_back(c);
        if (!c->authed) next = std::min(next, c->deadline);
      }
      int wait_ms = -1;
      if (next != Clock::time_point::max())
        wait_ms = int(std::max<int64_t>(
            0, std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count() +
                   1));
      if (::poll(fds.data(), fds.size(), wait_ms) < 0 && errno != EINTR) {
        say(fmt::format("poll failed: {}; the store stops", std::strerror(errno)));
        return;
      }
      if (fds[0].revents) return;  // the destructor's wake-up
      for (size_t i = 2; i < fds.size(); ++i) {
        auto c = which[i - 2];
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR))
          if (!read_from(c)) continue;
        if (!c->out.empty()) write_to(c);
      }
      if (fds[1].revents & POLLIN) accept_all();
      const auto now = Clock::now();
      for (auto c = conns.begin(); c != conns.end();) {
        auto here = c++;
        if (!here->authed && now >= here->deadline)
          drop(here, fmt::format("it did not authenticate within {:g} s",
                                 options.auth_timeout.count() / 1000.0));
      }
    }
  }
};

StoreServer::StoreServer(const std::string& host, int port, const StoreServerOptions& options)
    : impl_(std::make_unique<Impl>()) {
  impl_->options = options;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string port_text = std::to_string(port);
  if (const int rc = ::getaddrinfo(options.listen_all ? nullptr : host.c_str(), port_text.c_str(),
                                   &hints, &found);
      rc != 0)
    throw Error(fmt::format("rank 0 cannot listen on the master address '{}': it does not "
                            "resolve here ({})",
                            host, ::gai_strerror(rc)));
  std::string errors;
  for (addrinfo* a = found; a && impl_->listen_fd < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (a->ai_family == AF_INET6 && options.listen_all) {
      const int zero = 0;  // both IPv4 and IPv6 on "every interface"
      ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    }
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) {
      impl_->listen_fd = fd;
      break;
    }
    sockaddr_storage at{};
    std::memcpy(&at, a->ai_addr, std::min<size_t>(a->ai_addrlen, sizeof at));
    errors += fmt::format("{}{}: {}", errors.empty() ? "" : "; ", address_of(at),
                          std::strerror(errno));
    ::close(fd);
  }
  ::freeaddrinfo(found);
  if (impl_->listen_fd < 0)
    throw Error(fmt::format(
        "rank 0 could not start the rendezvous store on {}:{} ({}): the port is taken here "
        "(choose another MASTER_PORT), or MASTER_ADDR '{}' is not an address of rank 0's host "
        "(the store listens on that address only; STRATA_STORE_LISTEN_ALL=1 listens on every "
        "interface)",
        options.listen_all ? "every interface" : host, port, errors, host));
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  ::getsockname(impl_->listen_fd, reinterpret_cast<sockaddr*>(&bound), &length);
  impl_->port = bound.ss_family == AF_INET
                    ? ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port)
                    : ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
  if (::pipe2(impl_->wake, O_CLOEXEC) != 0) {
    ::close(impl_->listen_fd);
    throw Error(fmt::format("cannot start the rendezvous store: pipe: {}", std::strerror(errno)));
  }
  impl_->thread = std::thread([impl = impl_.get()] { impl->loop(); });
}

StoreServer::~StoreServer() {
  const char byte = 0;
  while (::write(impl_->wake[1], &byte, 1) < 0 && errno == EINTR) {
  }
  impl_->thread.join();
  for (Conn& c : impl_->conns) ::close(c.fd);
  ::close(impl_->listen_fd);
  ::close(impl_->wake[0]);
  ::close(impl_->wake[1]);
}

int StoreServer::port() const { return impl_->port; }

}  // namespace strata::comm::detail
