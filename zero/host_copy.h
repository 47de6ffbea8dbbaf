// Copies between host and device that leave the compute stream free.
//
// Device to host (optimizer offload's gradients): a CUDA source is copied into page-locked
// memory on a side stream that first waits for the compute stream, and the source's memory is
// kept from reuse until the copy is done; the caller waits with torch::cuda::synchronize() (or
// any device-wide wait) before reading the host buffer. Anything else is an ordinary copy_.
//
// Host to device (offload_param's gathers): SideStream makes a device's copy stream current
// after it has waited for what the caller's stream queued so far (the destination's bytes may
// have been in use there); the copies and collectives issued inside it run beside the compute
// stream, and done() hands back an event the consumer's stream waits for.
#pragma once

#include <functional>
#include <memory>
#include <utility>

#include <torch/torch.h>

#include "comm/process_group.h"
#include "offload/cpu_adam.h"

namespace strata::zero {

void copy_to_host_async(const torch::Tensor& host, const torch::Tensor& source);
// The same, and a way to wait for that one copy: the returned callable blocks the host until the
// copy is done (empty when the copy was synchronous and is done already).
std::function<void()> copy_to_host_tracked(const torch::Tensor& host, const torch::Tensor& source);

// A wait (for any thread) until the work queued so far on `device`'s current stream is done (empty
// for a CPU device): before the host rewrites memory a queued copy reads.
std::function<void()> queued_work_done(c10::Device device);

class SideStream {
 public:
  enum class Direction { kToHost, kToDevice };  // one copy stream each: both copy engines work
  // A CUDA device: its copy stream for `direction` (one per device and direction) becomes
  // current; anything else: nothing changes (active() is false).
  explicit SideStream(c10::Device device, Direction direction = Direction::kToDevice);
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  bool active() const { return state_ != nullptr; }
  // `t`'s bytes are used on the copy stream: not reused by the allocator before it is done.
  void uses(const torch::Tensor& t);
  // An event recorded on the copy stream now: wait() makes the then-current stream wait for the
  // work issued inside this scope; is_completed() asks the device. Null when not active().
  comm::WorkPtr done();
  // Blocks the host until everything issued on this device's host-to-device copy stream is
  // done: before the host rewrites memory a copy may still read.
  static void synchronize(c10::Device device);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// `numel` elements of `dtype` in host memory, 4096-aligned and page-locked for copies to `device`
// (cudaHostRegister of exactly those bytes; torch's pinned allocator rounds each block up to a
// power of two: a 5.4 GB buffer locks 8 GiB, and its cudaHostAlloc of the rounded size takes
// seconds). Undefined when the pages cannot be locked (the locked-memory limit, the memory);
// for a CPU device, or in a CPU build, aligned pageable memory.
torch::Tensor page_locked_empty(int64_t numel, torch::ScalarType dtype, c10::Device device);

// Page-locks [data, data + bytes) for copies to `device` (cudaHostRegister) while it lives, so
// that copies out of it are asynchronous; for a CPU device or in a CPU build it does nothing
// (active() false). Move-only.
class HostRegistration {
 public:
  HostRegistration() = default;
  HostRegistration(void* data, size_t bytes, c10::Device device);
  ~HostRegistration();
  HostRegistration(HostRegistration&& o) noexcept : data_(o.data_) { o.data_ = nullptr; }
  HostRegistration& operator=(HostRegistration&& o) noexcept {
    std::swap(data_, o.data_);
    return *this;
  }
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;
  bool active() const { return data_ != nullptr; }

 private:
  void* data_ = nullptr;
};

// The CPU kernels' name for a host tensor's dtype (offload/cpu_adam.h): fp32, bf16 or fp16;
// another dtype is refused by name.
offload::Float host_float(torch::ScalarType type);
inline offload::Float host_float(const torch::Tensor& t) { return host_float(t.scalar_type()); }

}  // namespace strata::zero
