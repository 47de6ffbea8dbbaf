// PartitionedOptimizer's offloaded step (offload_optimizer): the CPU Adam over the host master in
// tiles, each tile's new weights sent back as it is written; on one data-parallel rank at stages
// 1-2 the step runs on a worker thread overlapped with the next forward (weight_arrival.h); with
// the state in NVMe swap files, the tiles stream through the swapper.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "offload/cpu_adam.h"
#include "runtime/error.h"
#include "runtime/log.h"
#include "zero/host_copy.h"
#include "zero/partitioned_optimizer.h"

namespace strata::zero {

void PartitionedOptimizer::apply_offloaded(double clip_coef, const torch::Tensor& mine) {
  const auto t0 = std::chrono::steady_clock::now();
  if (swapper_ && units_ && units_->partition_offload() == "nvme") {
    // ZeRO-Infinity: state and parameters both on NVMe. The new 16-bit weights go from a tile
    // buffer to the parameters' swap file, so host memory holds no partition-sized copy of them.
    step_swapped(grad_scale_ * std::min(clip_coef, 1.0), {});
    offload_times_.step_ms = std::chrono::duration<double, std::milli>(
                                 std::chrono::steady_clock::now() - t0).count();
    return;
  }
  // Parameters in host memory too: the step writes their new values into the host shards
  // themselves, no buffer and no copy between the two.
  const auto host_params = units_ ? units_->writable_host_partition() : torch::Tensor();
  if (host_params.defined())
    host_out_ = host_params;
  else if (!host_out_.defined())
    host_out_ = host_buffer(mine.numel(), mine.scalar_type());
  // Each tile goes back as soon as the CPU has written it; the copies queue on the device's
  // stream (asynchronous from page-locked memory) while the CPU steps the next tile.
  const bool offloaded_params = units_ && units_->partition_offload() != "none";
  auto send = [&](int64_t lo, int64_t n) {
    if (host_params.defined()) return;  // written in place
    if (offloaded_params)  // to the parameters' swap file
      units_->write_partition(lo, host_out_.narrow(0, lo, n));
    else
      mine.narrow(0, lo, n).copy_(host_out_.narrow(0, lo, n), /*non_blocking=*/host_out_.is_pinned());
  };
  if (swapper_) {
    step_swapped(grad_scale_ * std::min(clip_coef, 1.0), send);
  } else if (flat_step_) {
    flat_step_(grad_, grad_scale_ * std::min(clip_coef, 1.0), host_out_,
               options_.offload.tile_numel, send);
  } else {
    if (clip_coef < 1.0) grad_.mul_(clip_coef);
    master_.mutable_grad() = grad_;
    inner_->step();
    host_out_.copy_(master_);
    send(0, host_out_.numel());
  }
  offload_times_.step_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

bool PartitionedOptimizer::overlaps_step() const {
  // One partition: no all-gather has to wait for the whole step.
  return overlapped_step_ && offloads() && !swapper_ && !units_ && flat_ && shards_.parts() == 1;
}

void PartitionedOptimizer::start_overlapped_step(double clip_coef) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto& flat = flat_->data();
  if (!host_out_.defined()) host_out_ = host_buffer(shards_.partition_numel(), flat.scalar_type());
  if (!arrival_) arrival_ = std::make_unique<WeightArrival>(flat);
  // Tiles in flat order: partition [part, part + n) holds flat [flat, flat + n) (stage 1: the
  // identity; stage 2: each bucket's chunk, the buckets laid out last parameter first).
  struct Tile {
    int64_t part, flat, n;
  };
  std::vector<Tile> tiles;
  const int64_t tile = options_.offload.tile_numel > 0 ? options_.offload.tile_numel
                                                       : shards_.partition_numel();
  auto cut = [&](int64_t part, int64_t lo, int64_t n) {
    for (int64_t o = 0; o < n; o += tile) tiles.push_back({part + o, lo + o, std::min(tile, n - o)});
  };
  if (shards_.is_contiguous()) {
    cut(0, 0, flat_->numel());
  } else {
    auto buckets = shards_.buckets();
    std::sort(buckets.begin(), buckets.end(), [](const auto& a, const auto& b) { return a.lo < b.lo; });
    for (const auto& b : buckets) cut(b.base, b.lo, b.hi - b.lo);
  }
  std::vector<int64_t> ends;
  for (const auto& t : tiles) ends.push_back(t.flat + t.n);
  // The step's numbers are taken here, before the caller moves the LR schedule on.
  const auto adam = overlapped_step_(grad_scale_ * std::min(clip_coef, 1.0));
  for (const auto* m : {&adam.exp_avg, &adam.exp_avg_sq})
    if (!m->is_cpu() || m->scalar_type() != torch::kFloat || !m->is_contiguous() ||
        m->numel() != master_.numel())
      throw Error("PartitionedOptimizer: the overlapped step's moments must be contiguous fp32 "
                  "host tensors shaped like the master weights");
  // The caller's thread count (a worker's OpenMP setting is not the caller's), less the core the
  // caller's thread needs to launch the forward on a GPU meanwhile.
  const int threads = std::max(1, at::get_num_threads() - (flat.is_cuda() ? 1 : 0));
  auto step_tile = [this, tiles, adam, threads, t0, flat, master = master_, grad = grad_,
                    out = host_out_](size_t k) {
    const auto& t = tiles[k];
    const int64_t g_size = grad.element_size(), out_size = out.element_size();
    offload::cpu_adam_step(master.data_ptr<float>() + t.part, adam.exp_avg.data_ptr<float>() + t.part,
                           adam.exp_avg_sq.data_ptr<float>() + t.part,
                           static_cast<const char*>(grad.data_ptr()) + t.part * g_size,
                           host_float(grad), static_cast<char*>(out.data_ptr()) + t.part * out_size,
                           host_float(out), t.n, adam.scalars, threads);
    flat.narrow(0, t.flat, t.n).copy_(out.narrow(0, t.part, t.n), /*non_blocking=*/out.is_pinned());
    if (k + 1 == tiles.size())
      offload_times_.step_ms = std::chrono::duration<double, std::milli>(
                                   std::chrono::steady_clock::now() - t0).count();
  };
  arrival_->start(std::move(ends), std::move(step_tile));
}

void PartitionedOptimizer::settle() {
  if (!arrival_ || !arrival_->in_flight()) return;
  torch::NoGradGuard no_grad;
  std::exception_ptr failure;
  try {
    arrival_->finish();
  } catch (...) {
    failure = std::current_exception();
  }
  zero_gradients();  // the step read them until now
  if (failure) std::rethrow_exception(failure);
}

void PartitionedOptimizer::step_swapped(double grad_scale,
                                        const std::function<void(int64_t, int64_t)>& send) {
  if (!swapped_scalars_)
    throw Error("optimizer offload to NVMe: no swapped step was given (use_swapped_step); only "
                "Strata's Adam/AdamW step swapped state");
  const auto scalars = swapped_scalars_(grad_scale);
  const auto* g = static_cast<const char*>(grad_.data_ptr());
  const auto g_type = host_float(grad_);
  const int64_t g_size = grad_.element_size();
  if (grad_swap_) grad_swap_->begin_pass(swapper_->tile_numel());
  auto grad_at = [&](int64_t lo, int64_t n) -> const void* {
    return grad_swap_ ? grad_swap_->tile(lo, n) : g + lo * g_size;
  };
  const int threads = at::get_num_threads();
  if (!send) {
    // Straight to the parameters' swap file (no host_out_): two tile buffers, each written out
    // while the next tile is stepped into the other.
    const auto dtype = units_->partition().scalar_type();
    const int64_t out_size = int64_t(c10::elementSize(dtype));
    for (auto& b : tile_out_)
      if (b.size() < size_t(swapper_->tile_numel() * out_size))
        b = offload::AlignedBuffer(size_t(swapper_->tile_numel() * out_size));
    int64_t t = 0;
    swapper_->for_each_tile([&](int64_t lo, int64_t n, float* p, float* m, float* v) {
      auto& out = tile_out_[t++ % 2];
      units_->flush_writes_from(out.data());  // this buffer's last write has landed; the
                                              // other buffer's stays in flight meanwhile
      offload::cpu_adam_step(p, m, v, grad_at(lo, n), g_type, out.data(), host_float(dtype), n,
                             scalars, threads);
      units_->write_partition(lo, torch::from_blob(out.data(), {n}, torch::TensorOptions(dtype)));
    });
    if (grad_swap_) grad_swap_->end_pass();
    return;
  }
  auto* out = static_cast<char*>(host_out_.data_ptr());
  const auto out_type = host_float(host_out_);
  const int64_t out_size = host_out_.element_size();
  // Each tile's new 16-bit weights go back to the device while the swapper writes its fp32
  // arrays to disk and reads the next tile's.
  swapper_->for_each_tile([&](int64_t lo, int64_t n, float* p, float* m, float* v) {
    offload::cpu_adam_step(p, m, v, grad_at(lo, n), g_type, out + lo * out_size, out_type, n,
                           scalars, threads);
    send(lo, n);
  });
  if (grad_swap_) grad_swap_->end_pass();
}

}  // namespace strata::zero
