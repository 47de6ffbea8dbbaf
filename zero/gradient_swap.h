// ZeRO-Infinity's gradient partition on NVMe. With the optimizer state in swap files (stage 3,
// offload_optimizer nvme) the host would still hold this rank's whole gradient partition between
// backward and step: 2 bytes per parameter in bf16, the largest host buffer left. Instead each
// reduced chunk goes to a swap file as backward produces it (staged through two small host
// buffers), and the step reads it back a tile at a time, one tile ahead, beside the state's tiles.
// DeepSpeed's ZeRO-Infinity swaps gradients out the same way. The store checks every page's
// CRC32C on the way back, as for the state.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include <torch/torch.h>

#include "offload/aligned_buffer.h"
#include "offload/nvme_store.h"
#include "zero/host_copy.h"

namespace strata::zero {

class GradientSwap {
 public:
  // A file of `numel` elements of `dtype` in `store`, named `name`.
  GradientSwap(offload::NvmeStore& store, const std::string& name, int64_t numel,
               torch::ScalarType dtype);
  ~GradientSwap();  // waits for what is in flight
  GradientSwap(const GradientSwap&) = delete;
  GradientSwap& operator=(const GradientSwap&) = delete;

  // The reduced chunk for partition elements [offset, offset + chunk.numel()), on any device, in
  // this swap's dtype; `offset` must be on the store's 4 KiB grid. From a GPU the copy out of
  // `chunk` runs on a copy stream into page-locked staging and returns at once (the chunk's
  // memory is kept from reuse until it is done); its disk write is sent when its staging buffer
  // is needed again or at flush(). From host memory it is copied before this returns.
  void write(int64_t offset, const torch::Tensor& chunk);
  void flush();  // every write has landed (its error, if any, is thrown)

  // The step's pass: tiles are asked for in order, [0, t), [t, 2t), ...; each call returns the
  // elements [lo, lo + n), valid until the next call, and starts reading the following tile.
  void begin_pass(int64_t tile_numel);
  const void* tile(int64_t lo, int64_t n);
  void end_pass();

  torch::ScalarType dtype() const { return dtype_; }
  int64_t numel() const { return numel_; }

 private:
  void read_ahead(int slot, int64_t lo);
  void send(int stage);  // the staged piece's copy has ended: its disk write goes out

  offload::NvmeStore& store_;
  offload::NvmeStore::FileId file_ = -1;
  int64_t numel_ = 0;
  torch::ScalarType dtype_;
  int64_t element_ = 0;
  offload::AlignedBuffer stage_[2];  // writes: one fills while the other is written
  std::optional<offload::NvmeTicket> staged_[2];
  HostRegistration pinned_[2];  // the staging page-locked for the chunks' GPU
  struct Pending {                // a piece copied (or being copied) in, not yet sent to disk
    bool pending = false;
    std::function<void()> copied;  // blocks until the copy is done (empty: done)
    int64_t offset = 0, n = 0;
  } pending_[2];
  int next_stage_ = 0;
  offload::AlignedBuffer tiles_[2];  // reads: this tile and the next
  std::optional<offload::NvmeTicket> reading_[2];
  int64_t tile_lo_[2] = {-1, -1};
  int64_t tile_numel_ = 0;
  int current_ = 0;
};

}  // namespace strata::zero
