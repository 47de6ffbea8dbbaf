#include "zero/weight_arrival.h"

#include <algorithm>
#include <cstdio>

#include <ATen/record_function.h>
#include <c10/core/StorageImpl.h>
#include <fmt/format.h>

#if STRATA_ZERO_HAS_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "runtime/error.h"

namespace strata::zero {

#if STRATA_ZERO_HAS_CUDA
struct WeightArrival::DeviceSide {
  explicit DeviceSide(c10::DeviceIndex index)
      : stream(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index)) {}
  c10::cuda::CUDAStream stream;
  std::vector<at::cuda::CUDAEvent> events;  // events[k]: tiles 0..k copied
  c10::StreamId waiting_stream = 0;         // the stream waited_ refers to
};
#else
struct WeightArrival::DeviceSide {};
#endif

namespace {

// RecordFunction callbacks are plain function pointers: one serves every arrival in flight,
// installed with the first and removed with the last. The mutex is held while an op waits, so
// finish() cannot unregister (and a destructor free) an arrival a callback is using.
std::mutex g_mutex;
std::vector<WeightArrival*> g_in_flight;
at::CallbackHandle g_arrival_callback = 0;

void wait_for_input(WeightArrival& a, const c10::IValue& input) {
  if (input.isTensor()) {
    a.wait_for_reads_of(input.toTensor());
  } else if (input.isTensorList()) {
    for (const at::Tensor& t : input.toTensorList().vec()) a.wait_for_reads_of(t);
  }
}

std::unique_ptr<at::ObserverContext> on_arrival_op_start(const at::RecordFunction& fn) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (auto* a : g_in_flight)
    for (const auto& input : fn.inputs()) wait_for_input(*a, input);
  return nullptr;
}

void watch(WeightArrival* a) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_in_flight.push_back(a);
  if (g_in_flight.size() == 1)
    g_arrival_callback = at::addGlobalCallback(at::RecordFunctionCallback(&on_arrival_op_start)
                                           .needsInputs(true)
                                           .scopes({at::RecordScope::FUNCTION}));
}

void unwatch(WeightArrival* a) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const auto it = std::find(g_in_flight.begin(), g_in_flight.end(), a);
  if (it == g_in_flight.end()) return;
  g_in_flight.erase(it);
  if (g_in_flight.empty()) {
    at::removeCallback(g_arrival_callback);
    g_arrival_callback = 0;
  }
}

}  // namespace

WeightArrival::WeightArrival(torch::Tensor flat) : flat_(std::move(flat)) {
  if (!flat_.defined() || !flat_.has_storage())
    throw Error("WeightArrival: the flat buffer must be a defined tensor with storage");
  storage_ = flat_.storage().unsafeGetStorageImpl();
  base_ = flat_.storage_offset();
#if STRATA_ZERO_HAS_CUDA
  if (flat_.is_cuda()) side_ = std::make_unique<DeviceSide>(flat_.device().index());
#else
  if (!flat_.is_cpu())
    throw Error("WeightArrival: weights on " + flat_.device().str() +
                ", but this build of Strata has no CUDA");
#endif
}

WeightArrival::~WeightArrival() {
  try {
    finish();
  } catch (const std::exception& e) {
    // stderr, not runtime/log: this layer's tests link no runtime.
    std::fprintf(stderr, "[strata] error: the overlapped optimizer step failed at exit: %s\n",
                 e.what());
  }
}

int64_t WeightArrival::waits() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return waits_;
}

void WeightArrival::start(std::vector<int64_t> tile_ends, std::function<void(size_t)> deliver) {
  finish();
  for (size_t k = 1; k < tile_ends.size(); ++k)
    if (tile_ends[k] < tile_ends[k - 1])
      throw Error("WeightArrival::start: the tiles' ends must not decrease");
  tile_ends_ = std::move(tile_ends);
#if STRATA_ZERO_HAS_CUDA
  if (side_) {
    const auto index = flat_.device().index();
    // The side stream's copies come after what the caller queued (nothing may still read the
    // old weights), and the last step's copies are done before the host buffers are rewritten.
    side_->stream.synchronize();
    at::cuda::CUDAEvent queued;
    queued.record(c10::cuda::getCurrentCUDAStream(index));
    queued.block(side_->stream);
    side_->events.clear();
    side_->events.resize(tile_ends_.size());
    side_->waiting_stream = c10::cuda::getCurrentCUDAStream(index).id();
  }
#endif
  arrived_ = 0;
  waited_ = -1;
  waits_ = 0;
  worker_done_ = false;
  failure_ = nullptr;
  watch(this);
  try {
    worker_ = std::thread([this, deliver = std::move(deliver)] { run(deliver); });
  } catch (...) {
    unwatch(this);
    throw;
  }
}

void WeightArrival::run(const std::function<void(size_t)>& deliver) {
  at::DisableRecordFunctionGuard no_callbacks;  // this thread's own copies must not wait
  torch::NoGradGuard no_grad;
  try {
#if STRATA_ZERO_HAS_CUDA
    c10::optional<c10::cuda::CUDAStreamGuard> on_side;
    if (side_) on_side.emplace(side_->stream);
#endif
    for (size_t k = 0; k < tile_ends_.size(); ++k) {
      deliver(k);
#if STRATA_ZERO_HAS_CUDA
      if (side_) side_->events[k].record(side_->stream);
#endif
      {
        std::lock_guard<std::mutex> lock(mutex_);
        arrived_ = int64_t(k) + 1;
      }
      arrived_cv_.notify_all();
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    failure_ = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    worker_done_ = true;
  }
  arrived_cv_.notify_all();
}

void WeightArrival::wait_for_reads_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || t.numel() == 0) return;
  if (t.storage().unsafeGetStorageImpl() != storage_) return;
  // The highest element the op may read: tiles arrive in flat order, so its tile covers the rest.
  int64_t hi = t.storage_offset() - base_;
  for (int64_t d = 0; d < t.dim(); ++d) hi += (t.size(d) - 1) * std::abs(t.stride(d));
  if (hi < 0) return;
  const auto it = std::upper_bound(tile_ends_.begin(), tile_ends_.end(), hi);
  // Past the last tile: padding, or more than any tile rewrites; the last tile covers it.
  wait_for_tile(std::min<int64_t>(it - tile_ends_.begin(), int64_t(tile_ends_.size()) - 1));
}

void WeightArrival::wait_for_tile(int64_t tile) {
  if (tile < 0) return;
  std::unique_lock<std::mutex> lock(mutex_);
#if STRATA_ZERO_HAS_CUDA
  // A stream the caller switched to has waited for nothing yet.
  if (side_) {
    const auto id = c10::cuda::getCurrentCUDAStream(flat_.device().index()).id();
    if (id != side_->waiting_stream) {
      side_->waiting_stream = id;
      waited_ = -1;
    }
  }
#endif
  if (tile <= waited_) return;
  if (arrived_ <= tile) {
    ++waits_;
    arrived_cv_.wait(lock, [&] { return arrived_ > tile || worker_done_; });
    if (arrived_ <= tile) return;  // the worker failed; finish() reports it
  }
#if STRATA_ZERO_HAS_CUDA
  if (side_)
    side_->events[size_t(tile)].block(c10::cuda::getCurrentCUDAStream(flat_.device().index()));
#endif
  waited_ = tile;
}

std::function<void()> WeightArrival::copies_done() {
#if STRATA_ZERO_HAS_CUDA
  if (side_) {
    auto done = std::make_shared<at::cuda::CUDAEvent>();
    done->record(side_->stream);
    return [done] { done->synchronize(); };
  }
#endif
  return {};
}

void WeightArrival::finish() {
  if (!worker_.joinable()) return;
  worker_.join();
  unwatch(this);
#if STRATA_ZERO_HAS_CUDA
  // Whatever the caller queues next runs after every copy.
  if (side_ && arrived_ > 0)
    side_->events[size_t(arrived_ - 1)].block(
        c10::cuda::getCurrentCUDAStream(flat_.device().index()));
#endif
  waited_ = -1;
  if (failure_) {
    auto failure = failure_;
    failure_ = nullptr;
    std::rethrow_exception(failure);
  }
}

}  // namespace strata::zero
