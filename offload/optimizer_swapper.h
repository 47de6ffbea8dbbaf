// ZeRO-Infinity's optimizer swapper: the fp32 master weights and Adam's two moments of one
// partition live in three files of an NvmeStore (master, exp_avg, exp_avg_sq), not in memory. A
// step streams them through host memory tile by tile (DeepSpeed's sub_group_size): while tile t
// is stepped on the CPU, tile t + 1 is read (pipeline_read) and tile t - 1 written back
// (pipeline_write), through two sets of aligned buffers, so the disk, not the CPU or waiting, is
// the bound. Memory: 2 sets x 3 arrays x tile_numel floats, whatever the partition's size.
//
// With `resident_numel` (offload_optimizer.max_in_cpu), the first tiles that fit in it stay in
// host memory, stepped in place (no I/O), and only the rest has files: the optimizer on NVMe for
// what host memory cannot hold. The first swapped tile is read while the resident ones are stepped.
//
// Tiles are cut at multiples of 1024 elements (4 KiB, O_DIRECT's grid), so every tile's offset
// in each file is aligned; the last tile takes the rest. The store checks every page it reads
// against the CRC32C it kept when writing it: a flipped byte in a swap file is an error naming
// the file and offset, never a silently wrong weight.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>

#include "offload/aligned_buffer.h"
#include "offload/nvme_store.h"

namespace strata::offload {

struct SwapperOptions {
  int64_t tile_numel = 1 << 20;  // elements per tile (rounded up to 1024)
  bool pipeline_read = true;     // read the next tile while this one is stepped
  bool pipeline_write = true;    // write this tile back while the next one is stepped
  int64_t resident_numel = 0;    // elements of each array kept in host memory (whole tiles)
};

// Where the last pass's time went (ms): waiting for reads, the caller's work, waiting for writes.
struct SwapTimes {
  double read_wait_ms = 0, compute_ms = 0, write_wait_ms = 0;
};

class OptimizerSwapper {
 public:
  enum Array { kMaster = 0, kExpAvg = 1, kExpAvgSq = 2 };
  static constexpr int kArrays = 3;

  // Creates the three files, `prefix` + ".master" / ".exp_avg" / ".exp_avg_sq", of numel floats
  // in `store` (which must outlive this). Their contents start undefined: write every array
  // (write_array) before the first pass.
  OptimizerSwapper(NvmeStore& store, const std::string& prefix, int64_t numel,
                   SwapperOptions options = {});

  int64_t numel() const { return numel_; }
  int64_t tile_numel() const { return tile_; }
  int64_t tiles() const { return (numel_ + tile_ - 1) / tile_; }
  // Elements of each array in host memory (the first ones) and in the files (the rest).
  int64_t resident_numel() const { return std::min(numel_, resident_tiles_ * tile_); }
  int64_t swapped_numel() const { return numel_ - resident_numel(); }
  // The array's file ("" when every tile is resident).
  std::string path(Array a) const { return swapped_numel() > 0 ? store_.path(files_[a]) : std::string(); }

  // A whole array from memory to its file, or back (initialisation, checkpoints), through the
  // tile buffers; `src`/`dst` hold numel floats and need no alignment.
  void write_array(Array a, const float* src);
  void read_array(Array a, float* dst) const;
  // The same with a constant (zeroed moments).
  void fill_array(Array a, float value);
  // The same a tile at a time, for arrays that do not exist whole in memory (a partition
  // converted from 16 bits, a checkpoint's tensor): produce(offset, n, dst) fills n floats of
  // the array from `offset`; consume(offset, n, src) takes them.
  using TileOut = std::function<void(int64_t offset, int64_t n, float* dst)>;
  using TileIn = std::function<void(int64_t offset, int64_t n, const float* src)>;
  void write_tiles(Array a, const TileOut& produce);
  void read_tiles(Array a, const TileIn& consume) const;

  // One pass over every tile in order: fn(offset, n, master, exp_avg, exp_avg_sq) reads and may
  // change the tile's three arrays (n floats each), which are then written back. Every read
  // and write is waited for before it returns (or throws).
  using TileFn = std::function<void(int64_t offset, int64_t n, float* master, float* exp_avg,
                                    float* exp_avg_sq)>;
  void for_each_tile(const TileFn& fn);
  const SwapTimes& last_times() const { return times_; }

 private:
  struct Set {
    AlignedBuffer array[kArrays];
    NvmeTicket read[kArrays], write[kArrays];
    bool reading = false, writing = false;
  };
  static float* data(Set& s, int a) { return reinterpret_cast<float*>(s.array[a].data()); }
  float* resident(int a, int64_t tile) const {
    return reinterpret_cast<float*>(resident_[a].data()) + tile * tile_;
  }
  uint64_t file_offset(int64_t tile) const {
    return static_cast<uint64_t>((tile - resident_tiles_) * tile_) * sizeof(float);
  }
  void start_read(Set& s, int64_t tile);
  void finish_read(Set& s);
  void start_write(Set& s, int64_t tile, int arrays_mask);
  void finish_write(Set& s);
  int64_t tile_length(int64_t tile) const;

  NvmeStore& store_;
  int64_t numel_, tile_;
  int64_t resident_tiles_ = 0;  // tiles [0, resident_tiles_) live in resident_, the rest in files_
  SwapperOptions options_;
  mutable AlignedBuffer resident_[kArrays];
  NvmeStore::FileId files_[kArrays];
  mutable Set sets_[2];  // read_tiles (const) borrows a buffer
  SwapTimes times_;
};

}  // namespace strata::offload
