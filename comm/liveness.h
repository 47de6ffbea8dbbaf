// Which rank is missing? Each process publishes a heartbeat key in the rendezvous store
// (strata/hb/<world rank>) from a background thread, carrying a beat counter and, for each of its
// groups, how many collectives it has called there. The hot path only bumps an atomic counter;
// the store is read only when something has already gone wrong: then a rank that did not take
// part is told apart as dead or hung (its beat stops), gone (it shut down), or alive but elsewhere
// (it has called fewer collectives on the group).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "comm/store.h"

namespace strata::comm::detail {

class Liveness {
 public:
  // Publishes the first heartbeat before returning; `client` is a store connection of its own.
  Liveness(int rank, int world_size, std::unique_ptr<Store> client,
           std::chrono::milliseconds interval);
  ~Liveness();  // stops the thread

  // Publishes how many collectives this process has called on `group`.
  void track(const std::string& group, std::shared_ptr<std::atomic<uint64_t>> called);

  std::chrono::milliseconds interval() const { return interval_; }
  // How long a beat must stay still before its process counts as dead or hung.
  std::chrono::milliseconds stale_window() const;

  // Collective #seq on `group` failed here (members are world ranks). Names the members that
  // did not take part and why; empty when none is found. Takes stale_window() to watch beats.
  std::string missing_in_collective(const std::string& group, const std::vector<int>& members,
                                    uint64_t seq);
  // Members (world ranks) that did not arrive at a rendezvous, each with what is known of it.
  std::string describe_absent(const std::vector<int>& missing, const std::string& what_they_skipped);

  // Stops beating and marks this rank as gone; rank 0 (the store's server) then waits, up to
  // `bound`, until every other rank is gone too, so that nobody loses the store mid-call.
  void shut_down(std::chrono::milliseconds bound);

  static std::string key(int rank) { return "strata/hb/" + std::to_string(rank); }

 private:
  struct Beat {
    bool exited = false;
    uint64_t beat = 0;
    std::map<std::string, uint64_t> called;
  };
  void loop();
  void publish(bool exited);
  std::optional<Beat> read(int rank);  // nullopt: no heartbeat key

  const int rank_, world_size_;
  const std::chrono::milliseconds interval_;
  std::mutex store_mu_;  // the client, shared by the thread and the diagnosing callers
  std::unique_ptr<Store> client_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  uint64_t beat_ = 0;
  std::vector<std::pair<std::string, std::shared_ptr<std::atomic<uint64_t>>>> groups_;
  std::thread thread_;
};

// "rank 3" for the world group, "rank 3 (rank 1 of group world/g0)" otherwise.
std::string rank_label(int world_rank, const std::vector<int>& members, const std::string& group);

}  // namespace strata::comm::detail
