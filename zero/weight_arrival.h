// ZeRO-Offload's step overlapped with the next forward. With the optimizer in host memory the
// CPU steps the flat partition tile by tile and each tile's new 16-bit weights travel back to the
// device; DeepSpeed's ZeRO-Offload waits for the last tile before the next forward starts. Here
// the tiles are stepped on a worker thread and the caller goes on at once: an op that reads a
// range of the device buffer whose tile has not arrived yet waits for it (the host until the
// tile's copy is queued, the op's stream until the copy is done), so the forward's first layers
// run while the CPU still steps the last ones. The flat layout follows the module's parameter
// order, which is the order a forward usually reads them in.
//
// Ops are seen through a global RecordFunction callback with inputs (the mechanism stage 3's
// coordinator uses, zero/param_coordinator.h), installed only while tiles are in flight. Access
// that bypasses the dispatcher (a raw data_ptr read) is not seen: call finish() first.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <torch/torch.h>

namespace strata::zero {

class WeightArrival {
 public:
  // `flat`: the device buffer (CPU or CUDA) whose weights the step rewrites; ops reading any
  // view of its storage are watched while a step is in flight.
  explicit WeightArrival(torch::Tensor flat);
  ~WeightArrival();  // waits for the worker; a failure there is logged, not thrown
  WeightArrival(const WeightArrival&) = delete;
  WeightArrival& operator=(const WeightArrival&) = delete;

  // Runs deliver(k) for k = 0, 1, ... on a worker thread: it steps tile k and queues the copy of
  // its new weights into `flat` (on the worker's current stream: a side stream for a GPU; from
  // page-locked memory the copy is asynchronous). Once deliver(k) returns, flat elements
  // [0, tile_ends[k]) count as arrived (tile_ends increases). Returns at once; one step at a time.
  void start(std::vector<int64_t> tile_ends, std::function<void(size_t k)> deliver);
  // Waits until every tile has arrived (the caller's current stream included), stops watching
  // ops, and rethrows what the worker threw. Does nothing when no step is in flight.
  void finish();
  bool in_flight() const { return worker_.joinable(); }
  // A wait (for any thread) until the copies queued so far are done: before the host rewrites the
  // buffer they read. Empty where copies are synchronous (CPU).
  std::function<void()> copies_done();
  // Times an op had to wait for a tile still being stepped, since the last start().
  int64_t waits() const;

  // For the op callback: blocks until the elements `t` reads have arrived.
  void wait_for_reads_of(const at::Tensor& t);

 private:
  void run(const std::function<void(size_t)>& deliver);
  void wait_for_tile(int64_t tile);

  torch::Tensor flat_;
  const c10::StorageImpl* storage_ = nullptr;  // flat_'s storage, for the op check
  int64_t base_ = 0;                           // flat_'s offset in it (elements)
  std::vector<int64_t> tile_ends_;

  std::thread worker_;
  mutable std::mutex mutex_;
  std::condition_variable arrived_cv_;
  int64_t arrived_ = 0;       // tiles whose copy is queued (and recorded, on a GPU)
  bool worker_done_ = false;  // finished or failed: nothing more will arrive
  std::exception_ptr failure_;
  int64_t waited_ = -1;       // the highest tile the caller's stream already waits for
  int64_t waits_ = 0;
  struct DeviceSide;          // the side stream and one event per tile (CUDA builds)
  std::unique_ptr<DeviceSide> side_;
};

}  // namespace strata::zero
