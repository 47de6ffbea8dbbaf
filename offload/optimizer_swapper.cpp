#include "offload/optimizer_swapper.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <new>

#include <fmt/format.h>

#include "runtime/error.h"
#include "runtime/util/clock.h"

namespace strata::offload {
namespace {

constexpr int64_t kTileGrain = kIoAlign / sizeof(float);  // 1024 floats: one page
const char* const kSuffix[OptimizerSwapper::kArrays] = {".master", ".exp_avg", ".exp_avg_sq"};

}  // namespace

OptimizerSwapper::OptimizerSwapper(NvmeStore& store, const std::string& prefix, int64_t numel,
                                   SwapperOptions options)
    : store_(store), numel_(numel), options_(options) {
  if (numel < 1) throw Error(fmt::format("optimizer swapper '{}': {} elements", prefix, numel));
  if (options.tile_numel < 1)
    throw Error(fmt::format("optimizer swapper '{}': tile of {} elements (sub_group_size must be "
                            "at least 1)", prefix, options.tile_numel));
  tile_ = std::min((options.tile_numel + kTileGrain - 1) / kTileGrain * kTileGrain,
                   (numel + kTileGrain - 1) / kTileGrain * kTileGrain);
  if (options.resident_numel < 0)
    throw Error(fmt::format("optimizer swapper '{}': {} elements in host memory", prefix,
                            options.resident_numel));
  resident_tiles_ = options.resident_numel >= numel ? tiles() : options.resident_numel / tile_;
  try {
    if (resident_tiles_ > 0)
      for (auto& r : resident_) r = AlignedBuffer(static_cast<size_t>(resident_numel()) * sizeof(float));
  } catch (const std::bad_alloc&) {
    throw Error(fmt::format("optimizer swapper '{}': host memory for {} elements of each of the "
                            "master and both moments ({:.2f} GB) could not be allocated; lower "
                            "zero_optimization.offload_optimizer.max_in_cpu",
                            prefix, resident_numel(), 12.0 * double(resident_numel()) / 1e9));
  }
  if (swapped_numel() == 0) return;  // no files, no tile buffers
  for (int a = 0; a < kArrays; ++a)
    files_[a] = store_.create(prefix + kSuffix[a], static_cast<uint64_t>(swapped_numel()) * sizeof(float));
  for (auto& s : sets_)
    for (auto& buffer : s.array) buffer = AlignedBuffer(static_cast<size_t>(tile_) * sizeof(float));
}

int64_t OptimizerSwapper::tile_length(int64_t tile) const {
  return std::min(tile_, numel_ - tile * tile_);
}

void OptimizerSwapper::start_read(Set& s, int64_t tile) {
  const uint64_t offset = file_offset(tile);
  const uint64_t bytes = static_cast<uint64_t>(tile_length(tile)) * sizeof(float);
  for (int a = 0; a < kArrays; ++a) s.read[a] = store_.read(files_[a], offset, data(s, a), bytes);
  s.reading = true;
}

void OptimizerSwapper::finish_read(Set& s) {
  if (!s.reading) return;
  s.reading = false;
  for (auto& t : s.read) store_.wait(t);
}

void OptimizerSwapper::start_write(Set& s, int64_t tile, int arrays_mask) {
  const uint64_t offset = file_offset(tile);
  const uint64_t bytes = static_cast<uint64_t>(tile_length(tile)) * sizeof(float);
  for (int a = 0; a < kArrays; ++a)
    if (arrays_mask & (1 << a)) s.write[a] = store_.write(files_[a], offset, data(s, a), bytes);
    else s.write[a] = NvmeTicket();
  s.writing = true;
}

void OptimizerSwapper::finish_write(Set& s) {
  if (!s.writing) return;
  s.writing = false;
  for (auto& t : s.write) store_.wait(t);
}

void OptimizerSwapper::for_each_tile(const TileFn& fn) {
  times_ = {};
  const int64_t n = tiles(), first = resident_tiles_;
  try {
    if (first < n) start_read(sets_[0], first);  // arrives while the resident tiles are stepped
    for (int64_t t = 0; t < first; ++t) {
      const auto t0 = std::chrono::steady_clock::now();
      fn(t * tile_, tile_length(t), resident(kMaster, t), resident(kExpAvg, t), resident(kExpAvgSq, t));
      times_.compute_ms += ms_since(t0);
    }
    for (int64_t t = first; t < n; ++t) {
      Set& cur = sets_[(t - first) % 2];
      Set& next = sets_[(t - first + 1) % 2];
      auto t0 = std::chrono::steady_clock::now();
      finish_read(cur);
      times_.read_wait_ms += ms_since(t0);
      if (t + 1 < n && options_.pipeline_read) {
        t0 = std::chrono::steady_clock::now();
        finish_write(next);  // tile t - 1 leaves the other set before tile t + 1 comes in
        times_.write_wait_ms += ms_since(t0);
        start_read(next, t + 1);
      }
      t0 = std::chrono::steady_clock::now();
      fn(t * tile_, tile_length(t), data(cur, kMaster), data(cur, kExpAvg), data(cur, kExpAvgSq));
      times_.compute_ms += ms_since(t0);
      start_write(cur, t, 0b111);
      t0 = std::chrono::steady_clock::now();
      if (!options_.pipeline_write) finish_write(cur);
      if (t + 1 < n && !options_.pipeline_read) {
        finish_write(next);
        start_read(next, t + 1);
      }
      times_.write_wait_ms += ms_since(t0);
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (auto& s : sets_) finish_write(s);
    times_.write_wait_ms += ms_since(t0);
  } catch (...) {
    // Nothing may still point into the buffers when this returns.
    for (auto& s : sets_) s.reading = s.writing = false;
    try {
      store_.wait_all();
    } catch (...) {
    }
    throw;
  }
}

void OptimizerSwapper::write_tiles(Array a, const TileOut& produce) {
  for (int64_t t = 0; t < resident_tiles_; ++t) produce(t * tile_, tile_length(t), resident(a, t));
  Set& s = sets_[0];
  for (int64_t t = resident_tiles_; t < tiles(); ++t) {
    produce(t * tile_, tile_length(t), data(s, a));
    start_write(s, t, 1 << a);
    finish_write(s);
  }
}

void OptimizerSwapper::read_tiles(Array a, const TileIn& consume) const {
  for (int64_t t = 0; t < resident_tiles_; ++t) consume(t * tile_, tile_length(t), resident(a, t));
  Set& s = sets_[0];
  for (int64_t t = resident_tiles_; t < tiles(); ++t) {
    const uint64_t offset = file_offset(t);
    const uint64_t bytes = static_cast<uint64_t>(tile_length(t)) * sizeof(float);
    store_.wait(store_.read(files_[a], offset, data(s, a), bytes));
    consume(t * tile_, tile_length(t), data(s, a));
  }
}

void OptimizerSwapper::write_array(Array a, const float* src) {
  write_tiles(a, [src](int64_t offset, int64_t n, float* dst) {
    std::memcpy(dst, src + offset, static_cast<size_t>(n) * sizeof(float));
  });
}

void OptimizerSwapper::fill_array(Array a, float value) {
  write_tiles(a, [value](int64_t, int64_t n, float* dst) { std::fill(dst, dst + n, value); });
}

void OptimizerSwapper::read_array(Array a, float* dst) const {
  read_tiles(a, [dst](int64_t offset, int64_t n, const float* src) {
    std::memcpy(dst + offset, src, static_cast<size_t>(n) * sizeof(float));
  });
}

}  // namespace strata::offload
