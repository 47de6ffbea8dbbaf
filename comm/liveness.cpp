#include "comm/liveness.h"

#include <algorithm>
#include <sstream>

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::comm::detail {
namespace {

constexpr const char* kExitedCounter = "strata/exited";

std::string seconds(std::chrono::milliseconds ms) {
  return fmt::format("{:g} s", ms.count() / 1000.0);
}

}  // namespace

std::string rank_label(int world_rank, const std::vector<int>& members, const std::string& group) {
  if (group == "world") return fmt::format("rank {}", world_rank);
  auto it = std::find(members.begin(), members.end(), world_rank);
  return fmt::format("rank {} (rank {} of group {})", world_rank, it - members.begin(), group);
}

Liveness::Liveness(int rank, int world_size, std::unique_ptr<Store> client,
                   std::chrono::milliseconds interval)
    : rank_(rank), world_size_(world_size), interval_(interval), client_(std::move(client)) {
  publish(false);  // the first beat is also this rank's arrival at the rendezvous
  thread_ = std::thread([this] { loop(); });
}

Liveness::~Liveness() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::chrono::milliseconds Liveness::stale_window() const {
  return std::max(interval_ * 4, std::chrono::milliseconds(1500));
}

void Liveness::track(const std::string& group, std::shared_ptr<std::atomic<uint64_t>> called) {
  std::lock_guard<std::mutex> lock(mu_);
  groups_.emplace_back(group, std::move(called));
}

void Liveness::publish(bool exited) {
  std::string value;
  {
    std::lock_guard<std::mutex> lock(mu_);
    value = fmt::format("{} {}\n", exited ? "exit" : "alive", ++beat_);
    for (auto& [name, called] : groups_) value += fmt::format("{} {}\n", name, called->load());
  }
  std::lock_guard<std::mutex> lock(store_mu_);
  client_->set(key(rank_), value);
}

void Liveness::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, interval_, [this] { return stop_; });
    if (stop_) break;
    lock.unlock();
    try {
      publish(false);
    } catch (const std::exception&) {
      // The store is gone (rank 0 exited): the collectives will report it; keep quiet here.
    }
    lock.lock();
  }
}

std::optional<Liveness::Beat> Liveness::read(int rank) {
  std::string text;
  {
    std::lock_guard<std::mutex> lock(store_mu_);
    if (!client_->check({key(rank)})) return std::nullopt;
    text = client_->get(key(rank));
  }
  Beat b;
  std::istringstream in(text);
  std::string state;
  in >> state >> b.beat;
  b.exited = state == "exit";
  std::string name;
  uint64_t n = 0;
  while (in >> name >> n) b.called[name] = n;
  return b;
}

std::string Liveness::missing_in_collective(const std::string& group,
                                            const std::vector<int>& members, uint64_t seq) {
  std::vector<int> others;
  for (int r : members)
    if (r != rank_) others.push_back(r);
  try {
    std::map<int, std::optional<Beat>> first;
    for (int r : others) first[r] = read(r);
    const auto window = stale_window();
    std::this_thread::sleep_for(window);
    // `alive`: notes on members that still beat (behind, or ahead). Beside a member that died or
    // left they are its consequences, not causes: the others wait in the collective it broke, and
    // one that issued asynchronous collectives (ZeRO's bucketed reduce-scatters) has called past
    // this one without calling another sequence. Then only the dead and the gone are named.
    std::vector<std::string> culprits, alive, left;
    for (int r : others) {
      auto now = read(r);
      const std::string who = rank_label(r, members, group);
      if (!now) {
        culprits.push_back(who + " did not take part (it never joined: no heartbeat at all)");
        continue;
      }
      const bool stale = !now->exited && first[r] && first[r]->beat == now->beat;
      const uint64_t called = now->called.count(group) ? now->called.at(group) : 0;
      const std::string progress = fmt::format(
          "it has called {} collective{} on this group, this was #{}", called,
          called == 1 ? "" : "s", seq);
      if (called < seq) {
        if (stale)
          culprits.push_back(fmt::format("{} did not take part (no heartbeat for {}: its process "
                                         "died or hangs)",
                                         who, seconds(window)));
        else if (now->exited)
          culprits.push_back(who + " did not take part (it shut down its process group)");
        else
          alive.push_back(fmt::format("{} did not take part (alive, but {})", who, progress));
      } else if (stale) {
        culprits.push_back(fmt::format("{} took part, then stopped (no heartbeat for {}: its "
                                       "process died or hangs)",
                                       who, seconds(window)));
      } else if (called > seq && !now->exited) {
        alive.push_back(fmt::format("{} is ahead ({}): the ranks called different sequences of "
                                    "collectives",
                                    who, progress));
      } else if (now->exited) {
        left.push_back(who);
      }
    }
    if (culprits.empty()) culprits = alive;
    if (!culprits.empty()) {
      std::string text;
      for (size_t i = 0; i < culprits.size(); ++i) text += (i ? "; " : "") + culprits[i];
      return text;
    }
    if (!left.empty()) {
      std::string text;
      for (size_t i = 0; i < left.size(); ++i) text += (i ? ", " : "") + left[i];
      return text + " took part, then shut down (after an error of its own?)";
    }
    return "";
  } catch (const std::exception& e) {
    return fmt::format("the heartbeats could not be read ({}); rank 0, which serves the store, "
                       "has probably died",
                       e.what());
  }
}

std::string Liveness::describe_absent(const std::vector<int>& missing,
                                      const std::string& what_they_skipped) {
  try {
    std::map<int, std::optional<Beat>> first;
    for (int r : missing) first[r] = read(r);
    bool any_present = false;
    for (auto& [r, b] : first) any_present |= b.has_value();
    const auto window = stale_window();
    if (any_present) std::this_thread::sleep_for(window);
    std::string text;
    for (int r : missing) {
      std::string why;
      auto now = first[r] ? read(r) : std::nullopt;
      if (!now)
        why = "never arrived: no process registered as this rank";
      else if (now->exited)
        why = "has shut down its process group";
      else if (first[r]->beat == now->beat)
        why = fmt::format("no heartbeat for {}: its process died or hangs", seconds(window));
      else
        why = "alive, but it did not " + what_they_skipped;
      text += fmt::format("{}rank {} ({})", text.empty() ? "" : "; ", r, why);
    }
    return text;
  } catch (const std::exception& e) {
    return fmt::format("the heartbeats could not be read ({})", e.what());
  }
}

void Liveness::shut_down(std::chrono::milliseconds bound) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  try {
    publish(true);
    if (rank_ != 0) {
      std::lock_guard<std::mutex> lock(store_mu_);
      client_->add(kExitedCounter, 1);
      return;
    }
  } catch (const std::exception&) {
    return;  // the store is gone already
  }
  if (world_size_ == 1) return;
  // Rank 0 serves the store: wait until the others have left or stopped beating.
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + bound;
  std::map<int, std::pair<uint64_t, std::chrono::steady_clock::time_point>> last;
  auto next_scan = start + interval_;
  try {
    while (std::chrono::steady_clock::now() < deadline) {
      int64_t exited = 0;
      {
        std::lock_guard<std::mutex> lock(store_mu_);
        exited = client_->add(kExitedCounter, 0);
      }
      if (exited >= world_size_ - 1) return;
      const auto now = std::chrono::steady_clock::now();
      if (now >= next_scan) {  // count the ranks that died without saying goodbye
        next_scan = now + interval_;
        int gone = 0;
        for (int r = 1; r < world_size_; ++r) {
          auto b = read(r);
          uint64_t beat = b ? b->beat : 0;
          auto it = last.find(r);
          if (it == last.end() || it->second.first != beat) last[r] = {beat, now};
          if ((b && b->exited) || now - last[r].second >= stale_window()) ++gone;
        }
        if (gone >= world_size_ - 1) return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const std::exception&) {
  }
}

}  // namespace strata::comm::detail
