// A host buffer aligned for O_DIRECT: the kernel moves O_DIRECT data straight between the device
// and user memory, so the address, the length and the file offset must be multiples of the
// logical block size; 4096 covers every NVMe drive and file system in use. The NVMe store takes
// any buffer so aligned (pinned CUDA host memory later); this is the plain-memory one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <utility>

namespace strata::offload {

constexpr size_t kIoAlign = 4096;

inline constexpr uint64_t round_up_io(uint64_t n) { return (n + kIoAlign - 1) / kIoAlign * kIoAlign; }

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // `bytes` is rounded up to a multiple of 4096 (an O_DIRECT transfer is whole pages).
  explicit AlignedBuffer(size_t bytes) : size_(bytes) {
    if (bytes == 0) return;
    void* p = nullptr;
    if (posix_memalign(&p, kIoAlign, round_up_io(bytes)) != 0) throw std::bad_alloc();
    data_ = static_cast<std::byte*>(p);
  }
  AlignedBuffer(AlignedBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data_); }

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace strata::offload
