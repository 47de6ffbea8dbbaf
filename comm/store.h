// The rendezvous key-value store, served by rank 0 at MASTER_ADDR:MASTER_PORT: Strata's own
// (store_server.h; the wire protocol is store_wire.h), because c10d's TCPStore lets anyone who
// reaches the port read and write keys. Each connection proves the job's secret
// (STRATA_JOB_SECRET) by challenge-response and signs every message. Every call is bounded by the
// store's timeout; failures become strata::Error.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/env.h"

namespace strata::comm {

// Who may use the rendezvous store (comm/store.h), from the environment:
// - STRATA_JOB_SECRET: the job's secret, which every rank proves without sending it. strata-run
//   makes one per job; under SLURM or mpirun, export the same random value to every rank (at
//   least 16 characters). Unset: the store admits anyone who reaches it (a warning on rank 0
//   when the job spans hosts). The value is never printed.
// - STRATA_STORE_LISTEN_ALL=1: the store listens on every interface, not on MASTER_ADDR's only.
// - STRATA_STORE_AUTH_TIMEOUT: seconds a connection has to authenticate (default 5).
struct StoreAccess {
  std::string secret;
  bool listen_all = false;
  std::chrono::milliseconds auth_timeout{5000};
};
StoreAccess read_store_access(const EnvLookup& env = process_env());  // in env.cpp

}  // namespace strata::comm

namespace strata::comm::detail {

class StoreServer;

struct StoreAuth {
  std::string secret;       // the job's secret; "" is a store anyone speaking the protocol may use
  bool listen_all = false;  // the server listens on every interface, not only on the host given
  std::chrono::milliseconds auth_timeout{5000};  // a client must authenticate within this
};

class Store {
 public:
  // server: rank 0 serves (port 0 picks a free port) and connects to itself; others connect,
  // retrying until the timeout.
  static std::unique_ptr<Store> open(const std::string& host, int port, bool server,
                                     std::chrono::milliseconds timeout,
                                     const StoreAuth& auth = {});
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

// The loopback address `host` resolves to here when it is a host name (not an address literal)
// whose every address is a loopback one, as Debian's /etc/hosts maps the machine's own name to
// 127.0.1.1; "" otherwise. Ranks on other hosts cannot reach such a master.
std::string loopback_name(const std::string& host);

}  // namespace strata::comm::detail
