// Where a checkpoint's inputs wait for their recomputation, as the settings say (settings.h):
//   - as they are (the default): the tensors themselves, detached, kept alive;
//   - cpu_checkpointing: copied to host memory (page-locked for a GPU's tensors, copied without
//     making the host wait), the device's copy dropped; copied back when the recomputation needs
//     them, started one checkpoint ahead (when the checkpoint after this one in the forward
//     takes its inputs, which is in backward order the one before);
//   - contiguous_memory_optimization: copied into one buffer per device (on the tensor's device,
//     or page-locked host memory with cpu_checkpointing, copied back to the device as above)
//     sized at the first checkpoint for number_checkpoints of its size, so the checkpoints do not
//     fragment the allocator; every input of a checkpoint gets its own slice, and a buffer is
//     reused from its start once every checkpoint with a slice in it is gone;
//   - nvme_path: written to swap files of the io_uring store (offload/nvme_store.h: checksummed
//     pages, O_DIRECT) from a host staging buffer that is freed once the write is done; read back
//     one checkpoint ahead. Files are reused by later checkpoints of the same or smaller size;
//     the store's folder is removed when the settings are released (the engine's destruction).
// Tensors come back contiguous, with their dtype, shape and device, and without autograd
// history (the recomputation makes them leaves).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace strata::checkpointing {

struct StoreStats;

class SavedInputs {
 public:
  // Keeps `inputs` (undefined ones stay undefined) as the current settings say.
  static std::shared_ptr<SavedInputs> keep(const std::vector<torch::Tensor>& inputs);
  ~SavedInputs();
  SavedInputs(const SavedInputs&) = delete;
  SavedInputs& operator=(const SavedInputs&) = delete;

  // The inputs on their devices (waits for the copy or the read); releases where they were kept.
  std::vector<torch::Tensor> take();
  // Starts bringing the inputs back (NVMe read, host-to-device copy); take() finishes it.
  void prefetch();
  int64_t bytes() const { return bytes_; }

  struct Entry;

 private:
  friend StoreStats store_stats();
  SavedInputs() = default;
  std::vector<std::unique_ptr<Entry>> entries_;
  std::vector<std::string> arenas_;  // contiguous buffers counted as holding a slice of it
  uint64_t generation_ = 0;          // of the stores it was kept in
  int64_t bytes_ = 0;
  bool taken_ = false;
};

// The NVMe store, the contiguous buffers and the live checkpoints' list are process-wide
// (settings.cpp releases them with the settings); waits for I/O in flight.
void release_stores();
// Checkpoints kept and not yet taken, and their bytes where they are kept (tests, metrics).
struct StoreStats {
  int64_t live = 0;
  int64_t host_bytes = 0;
  int64_t nvme_files = 0;
  std::string nvme_folder;
};
StoreStats store_stats();

}  // namespace strata::checkpointing
