// ProcessGroup: the collectives Strata needs, over an explicit group of processes. The backend
// follows the tensors' device: Gloo for CPU tensors, NCCL for CUDA tensors (when built with NCCL).
// Groups are passed explicitly; nothing here is global.
//
// Tensors: broadcast, all_gather and all_to_all_single move bytes and take any dtype (bool masks,
// int8, int16, ...); reductions take float32/64, float16, bfloat16, int32, int64 and uint8. A
// non-contiguous tensor (channels_last, a transposed view) travels through a contiguous copy, and
// a result is copied back into it by Work::wait().
//
// Before each collective the members can compare their calls (which collective, dtype, sizes,
// root, splits), so that a mismatch is a strata::Error on every member instead of a rank
// aborted inside Gloo or stale data: on by default for CPU tensors, see comm/check.h and
// InitOptions::check.
//
// Every wait is bounded by the group's timeout (argument, else STRATA_TIMEOUT seconds, else
// 600 s). A rank that never arrives or dies turns into a strata::Error that names the collective
// and the missing rank(s), on every rank that waited for it; after such an error the group is
// broken and every later call on it throws the same error.
#pragma once

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/env.h"

namespace strata::comm {

enum class ReduceOp { Sum, Avg, Max, Min };
const char* to_string(ReduceOp op);

// A collective in flight. For CPU tensors, wait() blocks until the collective has finished (or
// failed: then it throws its strata::Error). For CUDA tensors, wait() orders the caller's current
// stream after the collective (cudaStreamWaitEvent; the host does not block) and throws if the
// collective has already failed; a collective that outlives the timeout is failed by a watchdog,
// which aborts the communicator, so the stream moves on and the next call throws. With
// InitOptions::blocking_wait (or STRATA_NCCL_BLOCKING_WAIT=1) CUDA waits block the host too.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  // Non-blocking: true once the collective has finished or failed.
  virtual bool is_completed() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

class ProcessGroup;
using GroupPtr = std::shared_ptr<ProcessGroup>;

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;

  virtual int rank() const = 0;  // this process's rank in the group
  virtual int size() const = 0;
  // The world rank of each member, in group-rank order.
  virtual const std::vector<int>& world_ranks() const = 0;
  virtual const std::string& name() const = 0;  // "world", "world/g0", ...
  virtual std::chrono::milliseconds timeout() const = 0;

  // --- asynchronous collectives (all members call them in the same order) --------------------
  virtual WorkPtr all_reduce_async(torch::Tensor tensor, ReduceOp op = ReduceOp::Sum) = 0;
  // root is a rank of this group.
  virtual WorkPtr broadcast_async(torch::Tensor tensor, int root) = 0;
  // output.numel() == size() * input.numel(); rank r's input lands at [r * n, (r + 1) * n).
  virtual WorkPtr all_gather_async(torch::Tensor output, torch::Tensor input) = 0;
  // input.numel() == size() * output.numel(); rank r gets the reduction of every input's r-th
  // chunk.
  virtual WorkPtr reduce_scatter_async(torch::Tensor output, torch::Tensor input,
                                       ReduceOp op = ReduceOp::Sum) = 0;
  // As torch.distributed.all_to_all_single: splits along dim 0; empty split lists mean equal
  // splits (dim 0 divisible by size()). input_split_sizes[p] rows go to rank p,
  // output_split_sizes[p] rows come from rank p. Zero-size splits are allowed.
  virtual WorkPtr all_to_all_single_async(torch::Tensor output, torch::Tensor input,
                                          std::vector<int64_t> output_split_sizes = {},
                                          std::vector<int64_t> input_split_sizes = {}) = 0;
  // A host-side barrier over Gloo, also in groups used with CUDA tensors: it does not wait for
  // CUDA collectives still queued on a stream.
  virtual WorkPtr barrier_async() = 0;

  // --- blocking forms: the asynchronous call, then wait() -------------------------------------
  void all_reduce(const torch::Tensor& tensor, ReduceOp op = ReduceOp::Sum) {
    all_reduce_async(tensor, op)->wait();
  }
  void broadcast(const torch::Tensor& tensor, int root) { broadcast_async(tensor, root)->wait(); }
  void all_gather(const torch::Tensor& output, const torch::Tensor& input) {
    all_gather_async(output, input)->wait();
  }
  void reduce_scatter(const torch::Tensor& output, const torch::Tensor& input,
                      ReduceOp op = ReduceOp::Sum) {
    reduce_scatter_async(output, input, op)->wait();
  }
  void all_to_all_single(const torch::Tensor& output, const torch::Tensor& input,
                         std::vector<int64_t> output_split_sizes = {},
                         std::vector<int64_t> input_split_sizes = {}) {
    all_to_all_single_async(output, input, std::move(output_split_sizes),
                            std::move(input_split_sizes))
        ->wait();
  }
  void barrier() { barrier_async()->wait(); }

  // What this member has handed to all_to_all_single since the group was made, counted where
  // the call enters the backend: calls, and bytes bound for other members (its own split stays
  // in place and is counted apart). The MoE exchange's figures (moe/exchange.h) and tests read it.
  struct AllToAllTraffic {
    int64_t calls = 0;
    int64_t bytes_to_others = 0;
    int64_t bytes_to_self = 0;
  };
  AllToAllTraffic all_to_all_traffic() const {
    return {a2a_calls_.load(), a2a_bytes_to_others_.load(), a2a_bytes_to_self_.load()};
  }

  // --- sub-groups (collective over this group: every member calls, in the same order) ---------
  // `ranks` are ranks of *this* group, in the order that becomes the new group's rank order.
  // Returns nullptr on a rank that is not a member.
  virtual GroupPtr new_group(const std::vector<int>& ranks) = 0;
  // MPI_Comm_split: members with the same color form a group, ordered by (key, rank in this
  // group). A negative color joins no group and gets nullptr.
  virtual GroupPtr split(int color, int key) = 0;

 protected:
  void count_all_to_all(int64_t bytes_to_others, int64_t bytes_to_self) {
    a2a_calls_ += 1;
    a2a_bytes_to_others_ += bytes_to_others;
    a2a_bytes_to_self_ += bytes_to_self;
  }

 private:
  std::atomic<int64_t> a2a_calls_{0}, a2a_bytes_to_others_{0}, a2a_bytes_to_self_{0};
};

struct InitOptions {
  // Seconds; unset: STRATA_TIMEOUT, else 600.
  std::optional<double> timeout_s;
  // Rank/world/master; unset: read_rank_env() from the process environment.
  std::optional<RankEnv> env;
  // CUDA waits block the host (bounded by the timeout). Unset: STRATA_NCCL_BLOCKING_WAIT=1.
  std::optional<bool> blocking_wait;
  // Which collectives the members compare before running them (comm/check.h); the same on every
  // rank. Unset: STRATA_COMM_CHECK, else CommCheck::Cpu.
  std::optional<CommCheck> check;
};

// Meets the other ranks (rank 0 serves the rendezvous store at MASTER_ADDR:MASTER_PORT, which
// admits only ranks proving STRATA_JOB_SECRET: comm/store.h) and returns the world group.
// Throws strata::Error naming the ranks that did not arrive within the timeout.
GroupPtr init_process_group(const InitOptions& options = {});

// True when this build has the NCCL backend (CUDA tensors).
bool nccl_available();

}  // namespace strata::comm
