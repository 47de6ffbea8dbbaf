// What every group of one init_process_group shares (the store, the heartbeats, the Gloo
// device), and what a group's backends need to know about their group. Internal to comm/.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/env.h"
#include "comm/liveness.h"
#include "comm/store.h"

namespace strata::comm::detail {

struct Runtime {
  RankEnv env;
  std::chrono::milliseconds timeout{};
  bool blocking_wait = false;
  CommCheck check = CommCheck::Cpu;  // which calls the members compare first (check.h)
  std::unique_ptr<Store> store;  // this process's main connection (rank 0 serves it)
  std::unique_ptr<Liveness> liveness;
  std::shared_ptr<void> gloo_device;  // a gloo::transport::Device, opaque outside gloo_backend.cpp

  ~Runtime();  // marks this rank gone; rank 0 waits for the others before closing the store
};

// A group's identity, shared by its backends.
struct GroupInfo {
  std::shared_ptr<Runtime> rt;
  std::string name;              // also the store prefix of the group's keys
  int rank = 0;                  // in the group
  std::vector<int> world_ranks;  // members, in group-rank order
  std::shared_ptr<std::atomic<uint64_t>> called;  // collectives called on this group so far

  int size() const { return int(world_ranks.size()); }
};

// Once a collective fails, the group is broken: every later call throws the first error.
class GroupHealth {
 public:
  void fail(const std::string& message) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_) error_ = message;
  }
  std::optional<std::string> error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  mutable std::mutex mu_;
  std::optional<std::string> error_;
};

// The strata::Error text for collective #seq that failed on this rank after `elapsed`:
// "<collective> timed out after 3 s on rank 0 of 3: rank 2 did not take part (...)".
std::string failure_message(const GroupInfo& g, const std::string& collective, uint64_t seq,
                            std::chrono::milliseconds elapsed, bool timed_out,
                            const std::string& cause);

}  // namespace strata::comm::detail
