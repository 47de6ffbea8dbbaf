#include "comm/store.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::comm::detail {

struct Store::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
  std::chrono::milliseconds timeout;
};

namespace {

std::string what_of(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

template <class F>
auto guarded(const Store& s, const char* op, const std::string& key, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(fmt::format("rendezvous store at {}:{} failed on {}('{}'): {} (rank 0 serves the "
                            "store; it may have exited)",
                            s.host(), s.port(), op, key, what_of(e)));
  }
}

}  // namespace

Store::Store(std::unique_ptr<Impl> impl, std::string host, int port)
    : impl_(std::move(impl)), host_(std::move(host)), port_(port) {}
Store::~Store() = default;

std::unique_ptr<Store> Store::open(const std::string& host, int port, bool server,
                                   std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(port);
  opts.isServer = server;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  auto impl = std::make_unique<Impl>();
  impl->timeout = timeout;
  // A client retries until the deadline. Each attempt gets half of what is left: LibTorch 2.x's
  // TCPStore may itself try twice (with a back-off between), which would overrun the timeout.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string first_error;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    opts.timeout = server ? timeout : std::max(left / 2, std::chrono::milliseconds(100));
    try {
      impl->store = c10::make_intrusive<c10d::TCPStore>(host, opts);
      impl->store->setTimeout(timeout);
      break;
    } catch (const std::exception& e) {
      if (server)
        throw Error(fmt::format("rank 0 could not start the rendezvous store on port {} and "
                                "reach it at {}:{}: {}; the port is taken here (choose another "
                                "MASTER_PORT), or MASTER_ADDR '{}' is not an address of rank 0's "
                                "host that resolves there",
                                port, host, port, what_of(e), host));
      if (first_error.empty()) first_error = what_of(e);
      if (std::chrono::steady_clock::now() + std::chrono::milliseconds(50) >= deadline)
        throw Error(fmt::format("could not reach the rendezvous store at {}:{} within {:g} s: "
                                "rank 0 serves it, so rank 0 has not started, has died, or "
                                "MASTER_ADDR/MASTER_PORT are wrong ({})",
                                host, port, timeout.count() / 1000.0, first_error));
    }
  }
  const int actual = impl->store->getPort();
  return std::unique_ptr<Store>(new Store(std::move(impl), host, actual));
}

void Store::set(const std::string& key, const std::string& value) {
  guarded(*this, "set", key, [&] {
    impl_->store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  });
}

std::string Store::get(const std::string& key) {
  return guarded(*this, "get", key, [&] {
    auto v = impl_->store->get(key);
    return std::string(v.begin(), v.end());
  });
}

bool Store::check(const std::vector<std::string>& keys) {
  return guarded(*this, "check", keys.empty() ? "" : keys.front(),
                 [&] { return impl_->store->check(keys); });
}

int64_t Store::add(const std::string& key, int64_t delta) {
  return guarded(*this, "add", key, [&] { return impl_->store->add(key, delta); });
}

bool Store::wait_for(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  // Polling keeps the connection free of long blocking requests (a timed-out c10d wait can leave
  // the connection out of step) and lets the caller name what is missing.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::milliseconds(1);
  while (true) {
    if (check(keys)) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
}

}  // namespace strata::comm::detail
