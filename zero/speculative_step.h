// SuperOffload's speculative CPU step (offload_optimizer.super_offload), exact.
//
// With the optimizer in host memory, the CPU Adam of the boundary micro-step's gradients can start
// as each reduced piece lands in host memory during backward, instead of after the whole backward.
// What it cannot know yet is the step's scalars: the clipping coefficient needs the global norm,
// the overflow check every gradient, and the learning rate is the program's until step(). So the
// step speculates: it assumes no clipping, no overflow and the current learning rate, and writes
// the new master and moments into a second set of arrays, leaving the state it read untouched. At
// the step the engine gives the real scalars: equal (bit for bit) to the assumed ones, the second
// set becomes the state (a swap of storages, no copy); different (clipping applied, the learning
// rate changed) or an overflow, the speculative results are dropped and the ordinary step runs from
// the untouched state. Results are the synchronous step's, bit for bit (cpu_adam_step_to gives an
// element the same bits whatever pieces the partition is stepped in).
//
// The cost of "undo" is the second set: 12 bytes of host memory per parameter of the partition
// (fp32 master and both moments), and no extra memory traffic: the step reads one set and writes
// the other, as many bytes as a step in place. Keeping a backup instead would write 12 more bytes
// per parameter every step; undoing Adam arithmetically is not exact.
//
// The partition is cut into items (the pieces gradients arrive in, cut again into tiles); a worker
// thread adds each arriving piece into the accumulation (more than one micro-step) as soon as its
// copy lands, and steps the arrived items, lowest first (items are ordered as the next forward
// reads the weights: what is left at the end of backward, the first layers, is stepped in the
// order the forward needs it).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "offload/adam_math.h"

namespace strata::zero {

class SpeculativeStep {
 public:
  // An item: `n` elements at partition offset `part`; `flat`: its place in the device's flat
  // buffer where there is one (the overlapped step's tiles), else the partition offset.
  struct Item {
    int64_t part, flat, n;
  };
  // `items` cover the partition (or the part of it the CPU steps), in the order the step prefers
  // among arrived ones.
  explicit SpeculativeStep(std::vector<Item> items);
  ~SpeculativeStep();  // cancels a step in flight
  SpeculativeStep(const SpeculativeStep&) = delete;
  SpeculativeStep& operator=(const SpeculativeStep&) = delete;

  struct Arrays {
    torch::Tensor master, exp_avg, exp_avg_sq;  // fp32 host: the state stepped from
    torch::Tensor grad;      // the gradient the step reads
    torch::Tensor arriving;  // defined: each piece lands here and is added into `grad` first
    torch::Tensor out;       // the new weights in the model's dtype
  };
  // Starts a speculative step with the assumed scalars on `threads` CPU threads. `out_free`, when
  // given, returns once the copies that read `out` last step are done (asynchronous copies to a
  // GPU): the worker waits for it before it writes there.
  void begin(const Arrays& arrays, const optim::AdamScalars& assumed, int threads,
             std::function<void()> out_free = {});
  // Partition elements [part, part + n) of the gradient are on their way: in host memory once
  // `landed` returns (empty: already). Called by the thread that runs backward.
  void arrive(int64_t part, int64_t n, std::function<void()> landed);
  // A step begun and neither committed nor dropped.
  bool pending() const { return running_ && !committed_; }
  // Committed, its worker still stepping or done: finish() ends it.
  bool committed() const { return running_ && committed_; }
  // Every item has arrived, landed and been added: the gradient is whole in host memory. An item
  // that never arrived is an error (the reducer delivers every bucket before the step), not a wait.
  void wait_gradient();
  const optim::AdamScalars& assumed() const { return assumed_; }
  // The assumed scalars were right: the second set of arrays becomes the state (the worker goes on
  // with the items not stepped yet; wait_item / finish).
  void commit();
  // Blocks until item k is stepped (after commit()); rethrows a failure of the worker.
  void wait_item(size_t k);
  // Joins the worker: after commit() every item is stepped; rethrows its failure.
  void finish();
  // Drops the step: the worker stops after the item it is on and the state is as it was.
  void cancel();

  const std::vector<Item>& items() const { return items_; }
  // The worker's time in the Adam of the last step (ms), and its time added up over steps.
  double last_step_ms() const { return step_ms_; }
  // Host bytes of the second set.
  int64_t shadow_bytes() const;

 private:
  void run();
  void join();

  std::vector<Item> items_;
  std::vector<int64_t> starts_;  // items' partition offsets, ascending (items_ sorted by part)
  std::vector<size_t> by_part_;  // item indices in partition order
  Arrays arrays_;
  torch::Tensor shadow_master_, shadow_exp_avg_, shadow_exp_avg_sq_;
  optim::AdamScalars assumed_;
  std::function<void()> out_free_;
  int threads_ = 1;
  bool running_ = false, committed_ = false;

  std::thread worker_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  enum class State : uint8_t { kWaiting, kArrived, kAdded, kStepping, kStepped };
  std::vector<State> state_;
  std::vector<std::function<void()>> landed_;
  int64_t arrived_ = 0, added_ = 0, stepped_ = 0;
  bool cancel_ = false;
  std::exception_ptr failure_;
  double step_ms_ = 0;
};

}  // namespace strata::zero
