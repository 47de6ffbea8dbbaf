#include "zero/host_copy.h"

#include <mutex>

#include <fmt/format.h>

#include "offload/aligned_buffer.h"
#include "runtime/error.h"

#if STRATA_ZERO_HAS_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace strata::zero {

#if STRATA_ZERO_HAS_CUDA
namespace {

// One side stream per device and direction for the process, whichever thread asks (backward's
// ops run on autograd's device threads): copies to the host and to the device use the two copy
// engines side by side.
using Direction = SideStream::Direction;
c10::cuda::CUDAStream side_stream(c10::DeviceIndex index, Direction direction) {
  static std::mutex mutex;
  static c10::optional<c10::cuda::CUDAStream> side[2][64];
  std::lock_guard<std::mutex> lock(mutex);
  auto& stream = side[int(direction)][index];
  if (!stream) stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
  return *stream;
}

class EventWork : public comm::Work {
 public:
  explicit EventWork(c10::DeviceIndex index) : index_(index) {}
  at::cuda::CUDAEvent event;
  void wait() override { event.block(c10::cuda::getCurrentCUDAStream(index_)); }
  bool is_completed() override { return event.query(); }

 private:
  c10::DeviceIndex index_;
};

}  // namespace

struct SideStream::State {
  explicit State(c10::cuda::CUDAStream side) : stream(side), guard(stream) {}
  c10::cuda::CUDAStream stream;
  c10::cuda::CUDAStreamGuard guard;
};
#else
struct SideStream::State {};
#endif

SideStream::SideStream(c10::Device device, Direction direction) {
#if STRATA_ZERO_HAS_CUDA
  if (!device.is_cuda()) return;
  const auto index = device.index();
  const auto side = side_stream(index, direction);
  at::cuda::CUDAEvent ready;
  ready.record(c10::cuda::getCurrentCUDAStream(index));
  ready.block(side);
  state_ = std::make_unique<State>(side);
#else
  (void)device, (void)direction;
#endif
}

SideStream::~SideStream() = default;

void SideStream::uses(const torch::Tensor& t) {
#if STRATA_ZERO_HAS_CUDA
  if (state_ && t.is_cuda())
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), state_->stream);
#else
  (void)t;
#endif
}

comm::WorkPtr SideStream::done() {
#if STRATA_ZERO_HAS_CUDA
  if (!state_) return nullptr;
  auto work = std::make_shared<EventWork>(state_->stream.device_index());
  work->event.record(state_->stream);
  return work;
#else
  return nullptr;
#endif
}

void SideStream::synchronize(c10::Device device) {
#if STRATA_ZERO_HAS_CUDA
  if (device.is_cuda()) side_stream(device.index(), Direction::kToDevice).synchronize();
#else
  (void)device;
#endif
}

HostRegistration::HostRegistration(void* data, size_t bytes, c10::Device device) {
#if STRATA_ZERO_HAS_CUDA
  if (!device.is_cuda() || data == nullptr || bytes == 0) return;
  const auto status = cudaHostRegister(data, bytes, cudaHostRegisterDefault);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: the copies fall back to synchronous ones
    return;
  }
  data_ = data;
#else
  (void)data, (void)bytes, (void)device;
#endif
}

HostRegistration::~HostRegistration() {
#if STRATA_ZERO_HAS_CUDA
  if (data_) (void)cudaHostUnregister(data_);
#endif
}

std::function<void()> copy_to_host_tracked(const torch::Tensor& host, const torch::Tensor& source) {
  copy_to_host_async(host, source);
#if STRATA_ZERO_HAS_CUDA
  if (source.is_cuda() && host.is_pinned()) {
    auto copied = std::make_shared<at::cuda::CUDAEvent>();
    copied->record(side_stream(source.device().index(), Direction::kToHost));
    return [copied] { copied->synchronize(); };
  }
#endif
  return {};
}

std::function<void()> queued_work_done(c10::Device device) {
#if STRATA_ZERO_HAS_CUDA
  if (device.is_cuda()) {
    auto done = std::make_shared<at::cuda::CUDAEvent>();
    done->record(c10::cuda::getCurrentCUDAStream(device.index()));
    return [done] { done->synchronize(); };
  }
#endif
  (void)device;
  return {};
}

void copy_to_host_async(const torch::Tensor& host, const torch::Tensor& source) {
  if (source.is_cuda() && host.is_pinned()) {
    SideStream side(source.device(), SideStream::Direction::kToHost);
    side.uses(source);
    host.copy_(source, /*non_blocking=*/side.active());
    return;
  }
  host.copy_(source, /*non_blocking=*/host.is_pinned());
}

torch::Tensor page_locked_empty(int64_t numel, torch::ScalarType dtype, c10::Device device) {
  const size_t bytes = size_t(numel) * c10::elementSize(dtype);
  // Nothing to lock (a rank's empty share); from_blob over no data would never free its owner.
  if (bytes == 0) return torch::empty({numel}, torch::TensorOptions().dtype(dtype));
  struct Owner {  // members go in reverse: unlocked, then freed
    offload::AlignedBuffer buffer;
    HostRegistration locked;
  };
  auto owner = std::make_unique<Owner>();
  owner->buffer = offload::AlignedBuffer(bytes);
  if (device.is_cuda()) {
    owner->locked = HostRegistration(owner->buffer.data(), bytes, device);
    if (!owner->locked.active()) return {};
  }
  void* data = owner->buffer.data();
  auto* held = owner.release();
  return torch::from_blob(data, {numel}, [held](void*) { delete held; },
                          torch::TensorOptions().dtype(dtype).device(torch::kCPU));
}

offload::Float host_float(torch::ScalarType type) {
  if (type == torch::kFloat) return offload::Float::kF32;
  if (type == torch::kBFloat16) return offload::Float::kBF16;
  if (type == torch::kHalf) return offload::Float::kF16;
  throw Error(fmt::format("optimizer offload: gradients in {} are not supported (fp32, bf16 or fp16)",
                          c10::toString(type)));
}

}  // namespace strata::zero
