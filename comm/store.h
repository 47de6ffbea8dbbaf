// The rendezvous key-value store: LibTorch's own c10d::TCPStore, served by rank 0 at
// MASTER_ADDR:MASTER_PORT. This header hides c10d so that only store.cpp includes it. Every call
// is bounded by the store's timeout; failures become strata::Error.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace strata::comm::detail {

class Store {
 public:
  // server: rank 0 serves (port 0 picks a free port); others connect, retrying until the timeout.
  static std::unique_ptr<Store> open(const std::string& host, int port, bool server,
                                     std::chrono::milliseconds timeout);
  ~Store();

  const std::string& host() const { return host_; }
  int port() const { return port_; }

  void set(const std::string& key, const std::string& value);
  // Blocks until the key exists, up to the timeout.
  std::string get(const std::string& key);
  bool check(const std::vector<std::string>& keys);
  int64_t add(const std::string& key, int64_t delta);
  // Polls until every key exists; false when `timeout` passes first.
  bool wait_for(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);

 private:
  struct Impl;
  Store(std::unique_ptr<Impl> impl, std::string host, int port);
  std::unique_ptr<Impl> impl_;
  std::string host_;
  int port_;
};

}  // namespace strata::comm::detail
