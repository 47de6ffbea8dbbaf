// The rendezvous store's server, run by rank 0 on a thread of its own: one poll() loop over the
// listening socket and every connection, non-blocking throughout, so no peer can stall it.
//
// A connection first proves the job's secret (store_wire.h); until then it may send nothing but
// the 72-byte answer, and it is dropped after `auth_timeout` or at the first wrong byte, with one
// line on stderr naming its address (the first 20 such lines; then one line per 10 s counts the
// rest). Past 256 unauthenticated connections a new one evicts the oldest that has sent nothing,
// so that idle sockets held by anyone who reaches the port cannot keep the ranks out. An
// authenticated connection is dropped, also named, at a frame over kMaxPayload, a bad MAC or a
// malformed request; the others, and the keys, are untouched. The server listens on the master
// address only (every interface when `listen_all`).
#pragma once

#include <chrono>
#include <memory>
#include <string>

namespace strata::comm::detail {

struct StoreServerOptions {
  std::string secret;  // the job's secret; "" accepts anyone who speaks the protocol
  bool listen_all = false;
  std::chrono::milliseconds auth_timeout{5000};
};

class StoreServer {
 public:
  // Binds `host`:`port` (0: a free port) and starts serving. Throws strata::Error naming the
  // address when it cannot.
  StoreServer(const std::string& host, int port, const StoreServerOptions& options);
  ~StoreServer();  // stops the thread and closes every connection

  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::comm::detail
