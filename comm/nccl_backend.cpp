// NCCL collectives for CUDA tensors.
//
// Stream order: each call records an event on the caller's current stream, makes the group's
// stream wait for it, enqueues NCCL there and records a "done" event; Work::wait() makes the
// caller's current stream wait for "done". The host never synchronizes the device.
//
// Timeouts: the communicator is non-blocking (ncclConfig_t.blocking = 0), so no NCCL call can
// hold the host past the timeout (lazy connection set-up included). A watchdog thread watches the
// "done" events; a collective still running after the timeout, or an asynchronous NCCL error,
// aborts the communicator (the kernels return, the streams move on), marks the group broken with
// a message that names the missing ranks, and fails every collective still in flight.
#include "comm/nccl_backend.h"

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <nccl.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <iostream>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "runtime/error.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "Strata's NCCL backend needs NCCL 2.14 or newer (non-blocking communicators, ncclAvg)"
#endif

namespace strata::comm::detail {
namespace {

using Clock = std::chrono::steady_clock;
using ms = std::chrono::milliseconds;

// Reductions only; broadcast, all_gather and all_to_all move bytes (ncclUint8) for any dtype.
ncclDataType_t nccl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte: return ncclUint8;
    default: throw Error(fmt::format("NCCL: unsupported dtype {}", c10::toString(t)));
  }
}

// ncclAvg on floating types multiplies by 1/n before summing (PreMulSum), so a float16 mean that
// is representable does not overflow; the Gloo backend sums float16 in float32 for the same result.
ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ncclAvg;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  return ncclSum;
}

// What a Work and the watchdog share about one collective.
struct Flight {
  std::string name;
  uint64_t seq = 0;
  Clock::time_point start;
  std::shared_ptr<at::cuda::CUDAEvent> done;
  std::mutex mu;
  std::optional<std::string> error;

  void fail(const std::string& message) {
    std::lock_guard<std::mutex> lock(mu);
    if (!error) error = message;
  }
  std::optional<std::string> failed() {
    std::lock_guard<std::mutex> lock(mu);
    return error;
  }
};

class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<Flight> f, c10::Device device, bool blocking, ms bound)
      : f_(std::move(f)), device_(device), blocking_(blocking), bound_(bound) {}

  void wait() override {
    if (blocking_) {
      // Bounded: the watchdog fails the collective once it outlives the timeout.
      const auto deadline = f_->start + bound_;
      while (!f_->failed() && !f_->done->query()) {
        if (Clock::now() > deadline)
          throw Error(fmt::format("{} did not finish within {:g} s, and the watchdog did not "
                                  "report why",
                                  f_->name, bound_.count() / 1000.0));
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    if (auto e = f_->failed()) throw Error(*e);
    c10::cuda::CUDAGuard guard(device_);
    f_->done->block(c10::cuda::getCurrentCUDAStream(device_.index()));
  }

  bool is_completed() override { return f_->failed().has_value() || f_->done->query(); }

 private:
  std::shared_ptr<Flight> f_;
  c10::Device device_;
  bool blocking_;
  ms bound_;
};

class NcclBackend final : public Backend {
 public:
  NcclBackend(GroupInfo info, std::shared_ptr<GroupHealth> health, c10::Device device,
              const char* coll)
      : info_(std::move(info)),
        health_(std::move(health)),
        device_(device),
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index())) {
    connect(coll);
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclBackend() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    if (aborted_ || !comm_) return;
    // Finalize flushes what is in flight; bounded, then abort.
    c10::cuda::CUDAGuard guard(device_);
    const auto deadline = Clock::now() + std::min<ms>(timeout(), std::chrono::seconds(30));
    ncclResult_t st = ncclCommFinalize(comm_);
    while (st == ncclInProgress && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      ncclCommGetAsyncError(comm_, &st);
    }
    if (st == ncclSuccess)
      ncclCommDestroy(comm_);
    else
      ncclCommAbort(comm_);
  }

  // The group compared the calls already when asked to (check.h); call.check is unused here.
  WorkPtr all_reduce(torch::Tensor t, ReduceOp op, const Call& call) override {
    return launch("all_reduce", call.seq, {t}, [&](cudaStream_t s) {
      return ncclAllReduce(t.data_ptr(), t.data_ptr(), size_t(t.numel()),
                           nccl_type(t.scalar_type()), nccl_op(op), comm_, s);
    });
  }

  WorkPtr broadcast(torch::Tensor t, int root, const Call& call) override {
    return launch("broadcast", call.seq, {t}, [&](cudaStream_t s) {
      return ncclBroadcast(t.data_ptr(), t.data_ptr(), t.nbytes(), ncclUint8, root, comm_, s);
    });
  }

  WorkPtr all_gather(torch::Tensor out, torch::Tensor in, const Call& call) override {
    return launch("all_gather", call.seq, {out, in}, [&](cudaStream_t s) {
      return ncclAllGather(in.data_ptr(), out.data_ptr(), in.nbytes(), ncclUint8, comm_, s);
    });
  }

  WorkPtr reduce_scatter(torch::Tensor out, torch::Tensor in, ReduceOp op,
                         const Call& call) override {
    return launch("reduce_scatter", call.seq, {out, in}, [&](cudaStream_t s) {
      return ncclReduceScatter(in.data_ptr(), out.data_ptr(), size_t(out.numel()),
                               nccl_type(in.scalar_type()), nccl_op(op), comm_, s);
    });
  }

  WorkPtr all_to_all(torch::Tensor out, torch::Tensor in, std::vector<int64_t> out_counts,
                     std::vector<int64_t> in_counts, const Call& call) override {
    return launch("all_to_all_single", call.seq, {out, in}, [&](cudaStream_t s) {
      const ncclDataType_t type = ncclUint8;  // bytes: any dtype
      const size_t esize = in.element_size();
      char* src = static_cast<char*>(in.data_ptr());
      char* dst = static_cast<char*>(out.data_ptr());
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) return r;
      int64_t in_off = 0, out_off = 0;
      for (int p = 0; p < info_.size(); ++p) {
        if (in_counts[p] > 0 && r == ncclSuccess)
          r = ncclSend(src + in_off * esize, size_t(in_counts[p]) * esize, type, p, comm_, s);
        if (out_counts[p] > 0 && r == ncclSuccess)
          r = ncclRecv(dst + out_off * esize, size_t(out_counts[p]) * esize, type, p, comm_, s);
        in_off += in_counts[p];
        out_off += out_counts[p];
      }
      ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }

 private:
  ms timeout() const { return info_.rt->timeout; }

  std::string where() const {
    return info_.name == "world"
               ? fmt::format("rank {} of {}", info_.rank, info_.size())
               : fmt::format("rank {} of {} in group {}", info_.rank, info_.size(), info_.name);
  }

  // Waits until the non-blocking communicator has taken the last call; returns its state, or
  // ncclInProgress at the deadline.
  ncclResult_t settle(ncclResult_t st, Clock::time_point deadline) {
    while (st == ncclInProgress) {
      if (Clock::now() > deadline) return ncclInProgress;
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      ncclCommGetAsyncError(comm_, &st);
    }
    return st;
  }

  void connect(const char* coll) {
    Store& store = *info_.rt->store;
    const auto deadline = Clock::now() + timeout();
    const std::string prefix = "strata/nccl/" + info_.name + "/";
    auto key = [&](int r) { return prefix + "arrive/" + std::to_string(r); };
    ncclUniqueId id;
    if (info_.rank == 0) {
      if (ncclGetUniqueId(&id) != ncclSuccess)
        throw Error(fmt::format("{}: ncclGetUniqueId failed on {}", coll, where()));
      store.set(prefix + "id", std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
    }
    store.set(key(info_.rank), "1");
    std::vector<std::string> keys;
    for (int r = 0; r < info_.size(); ++r) keys.push_back(key(r));
    keys.push_back(prefix + "id");
    if (!store.wait_for(keys, timeout())) {
      std::vector<int> missing;
      for (int r = 0; r < info_.size(); ++r)
        if (!store.check({key(r)})) missing.push_back(info_.world_ranks[r]);
      throw Error(fmt::format(
          "{} timed out after {:g} s on {} setting up NCCL for group {}: {}", coll,
          timeout().count() / 1000.0, where(), info_.name,
          info_.rt->liveness->describe_absent(
              missing, "call a collective on CUDA tensors in this group")));
    }
    if (info_.rank != 0) {
      const std::string bytes = store.get(prefix + "id");
      if (bytes.size() != sizeof(id))
        throw Error(fmt::format("{}: the NCCL id in the store for group {} is damaged", coll,
                                info_.name));
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    c10::cuda::CUDAGuard guard(device_);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t st = ncclCommInitRankConfig(&comm_, info_.size(), id, info_.rank, &config);
    st = settle(st, deadline);
    if (st != ncclSuccess) {
      if (comm_) ncclCommAbort(comm_);
      comm_ = nullptr;
      throw Error(fmt::format("{}: NCCL set-up of group {} {} on {} ({})", coll, info_.name,
                              st == ncclInProgress ? "timed out" : "failed", where(),
                              st == ncclInProgress ? "a member stopped during set-up"
                                                   : ncclGetErrorString(st)));
    }
  }

  template <class Enqueue>
  WorkPtr launch(const char* name, uint64_t seq, std::initializer_list<torch::Tensor> tensors,
                 Enqueue&& enqueue) {
    c10::cuda::CUDAGuard guard(device_);
    std::unique_lock<std::mutex> lock(mu_);
    if (aborted_)
      throw Error(fmt::format("{} on group {}: the group is broken by an earlier error: {}", name,
                              info_.name, health_->error().value_or("NCCL was aborted")));
    auto flight = std::make_shared<Flight>();
    flight->name = name;
    flight->seq = seq;
    flight->start = Clock::now();
    flight->done = std::make_shared<at::cuda::CUDAEvent>();
    at::cuda::CUDAEvent ready;
    ready.record(c10::cuda::getCurrentCUDAStream(device_.index()));
    ready.block(stream_);
    for (const auto& t : tensors)
      if (t.numel() > 0)
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
    ncclResult_t st = settle(enqueue(stream_.stream()), flight->start + timeout());
    if (st != ncclSuccess) {
      const bool timed_out = st == ncclInProgress;
      fail_locked(lock, *flight,
                  timed_out ? "NCCL did not take the call in time"
                            : fmt::format("NCCL: {}", ncclGetErrorString(st)),
                  timed_out);
      throw Error(*flight->failed());
    }
    flight->done->record(stream_);
    pending_.push_back(flight);
    const ms bound = timeout() + 2 * info_.rt->liveness->stale_window() + std::chrono::seconds(5);
    return std::make_shared<NcclWork>(flight, device_, info_.rt->blocking_wait, bound);
  }

  // Diagnoses, aborts the communicator and fails everything in flight. Called with mu_ held.
  void fail_locked(std::unique_lock<std::mutex>& lock, Flight& culprit, const std::string& cause,
                   bool timed_out) {
    const auto elapsed = std::chrono::duration_cast<ms>(Clock::now() - culprit.start);
    const std::string message =
        failure_message(info_, culprit.name, culprit.seq, elapsed, timed_out, cause);
    // Mark first: the abort lets the "done" events complete, and a waiter that sees one complete
    // must already see the error.
    health_->fail(message);
    culprit.fail(message);
    for (auto& f : pending_) f->fail(message);
    pending_.clear();
    ncclCommAbort(comm_);
    aborted_ = true;
    (void)lock;
    // The caller may be blocked in a device synchronization and see nothing else.
    std::cerr << "strata: " << message << std::endl;
  }

  void watch() {
    c10::cuda::CUDAGuard guard(device_);
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_ && !aborted_) {
      cv_.wait_for(lock, ms(50), [this] { return stop_; });
      if (stop_ || aborted_) break;
      while (!pending_.empty() && pending_.front()->done->query()) pending_.pop_front();
      ncclResult_t st = ncclSuccess;
      ncclCommGetAsyncError(comm_, &st);
      if (st != ncclSuccess && st != ncclInProgress) {
        auto culprit = pending_.empty() ? std::make_shared<Flight>() : pending_.front();
        if (pending_.empty()) culprit->name = "a collective", culprit->start = Clock::now();
        fail_locked(lock, *culprit, fmt::format("NCCL: {}", ncclGetErrorString(st)), false);
      } else if (!pending_.empty() && Clock::now() - pending_.front()->start > timeout()) {
        auto culprit = pending_.front();
        fail_locked(lock, *culprit, "NCCL collective still running at the timeout", true);
      }
    }
  }

  GroupInfo info_;
  std::shared_ptr<GroupHealth> health_;
  c10::Device device_;
  c10::cuda::CUDAStream stream_;
  ncclComm_t comm_ = nullptr;
  std::mutex mu_;  // comm_ (enqueue against abort), pending_, aborted_, stop_
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Flight>> pending_;
  bool aborted_ = false;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace

std::unique_ptr<Backend> make_nccl_backend(const GroupInfo& info,
                                           std::shared_ptr<GroupHealth> health,
                                           const torch::Device& device, const char* coll) {
  return std::make_unique<NcclBackend>(info, std::move(health), device, coll);
}

}  // namespace strata::comm::detail
