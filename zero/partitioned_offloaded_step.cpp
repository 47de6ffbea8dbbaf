// PartitionedOptimizer's offloaded step (offload_optimizer): the CPU Adam over the host master in
// tiles, each tile's new weights sent back as it is written; on one data-parallel rank at stages
// 1-2 the step runs on a worker thread overlapped with the next forward (weight_arrival.h); with
// the state in NVMe swap files, the tiles stream through the swapper; with super_offload it starts
// during backward, speculatively (speculative_step.h).
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
  if (splits()) {
    // The device share steps on the device; the CPU steps the rest a tile at a time (Strata's
    // Adam: the flat step would step the whole host master).
    const auto adam = overlapped_step_(grad_scale_ * std::min(clip_coef, 1.0), /*advance=*/true);
    step_device_share(adam.scalars, mine);
    const int threads = at::get_num_threads();
    const auto g_type = host_float(grad_), out_type = host_float(host_out_);
    const int64_t g_size = grad_.element_size(), out_size = host_out_.element_size();
    for (const auto& t : step_items()) {
      if (in_device_share(t.part)) continue;
      offload::cpu_adam_step(master_.data_ptr<float>() + t.part, adam.exp_avg.data_ptr<float>() + t.part,
                             adam.exp_avg_sq.data_ptr<float>() + t.part,
                             static_cast<const char*>(grad_.data_ptr()) + t.part * g_size, g_type,
                             static_cast<char*>(host_out_.data_ptr()) + t.part * out_size, out_type,
                             t.n, adam.scalars, threads);
      send(t.part, t.n);
    }
  } else if (swapper_) {
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
  return overlapped_step_ && offloads() && !swapper_ && !units_ && flat_ && shards_.parts() == 1 &&
         !zenflow_;  // ZenFlow's window update is its own
}

bool PartitionedOptimizer::speculates() const {
  return options_.offload.speculative && overlapped_step_ && offloads() && !swapper_;
}

std::vector<SpeculativeStep::Item> PartitionedOptimizer::step_items() const {
  // Partition [part, part + n) holds flat [flat, flat + n) with one partition (stage 1: the
  // identity; stage 2: each bucket's chunk, the buckets laid out last parameter first); with
  // several, `flat` is only the order.
  std::vector<SpeculativeStep::Item> items;
  const int64_t tile = options_.offload.tile_numel > 0 ? options_.offload.tile_numel
                                                       : shards_.partition_numel();
  auto cut = [&](int64_t part, int64_t lo, int64_t n) {
    for (int64_t o = 0; o < n;) {
      int64_t len = std::min(tile, n - o);
      // No tile straddles the device share's bounds.
      for (const int64_t b : {device_lo_, device_hi_})
        if (splits() && part + o < b && part + o + len > b) len = b - (part + o);
      items.push_back({part + o, lo + o, len});
      o += len;
    }
  };
  if (shards_.is_contiguous()) {
    cut(0, 0, shards_.partition_numel());
  } else {
    auto buckets = shards_.buckets();
    std::sort(buckets.begin(), buckets.end(), [](const auto& a, const auto& b) { return a.lo < b.lo; });
    // One partition: a chunk past the bucket's end is padding outside the flat buffer.
    for (const auto& b : buckets) cut(b.base, b.lo, shards_.parts() == 1 ? b.hi - b.lo : b.chunk);
  }
  return items;
}

void PartitionedOptimizer::start_overlapped_step(double clip_coef) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto& flat = flat_->data();
  if (!host_out_.defined()) host_out_ = host_buffer(shards_.partition_numel(), flat.scalar_type());
  if (!arrival_) arrival_ = std::make_unique<WeightArrival>(flat);
  const auto tiles = step_items();  // in flat order
  std::vector<int64_t> ends;
  for (const auto& t : tiles) ends.push_back(t.flat + t.n);
  // The step's numbers are taken here, before the caller moves the LR schedule on.
  const auto adam = overlapped_step_(grad_scale_ * std::min(clip_coef, 1.0), /*advance=*/true);
  // The device share first, on the caller's stream: its tiles (the lowest) arrive at once.
  step_device_share(adam.scalars, {});
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
    if (in_device_share(t.part)) return;  // stepped on the device before the worker started
    const int64_t g_size = grad.element_size(), out_size = out.element_size();
    offload::cpu_adam_step(master.data_ptr<float>() + t.part, adam.exp_avg.data_ptr<float>() + t.part,
                           adam.exp_avg_sq.data_ptr<float>() + t.part,
                           static_cast<const char*>(grad.data_ptr()) + t.part * g_size,
                           host_float(grad), static_cast<char*>(out.data_ptr()) + t.part * out_size,
                           host_float(out), t.n, adam.scalars, threads);
    flat.narrow(0, t.flat, t.n).copy_(out.narrow(0, t.part, t.n), /*non_blocking=*/out.is_pinned());
    if (k + 1 == tiles.size())
      overlapped_step_ms_ = std::chrono::duration<double, std::milli>(
                                std::chrono::steady_clock::now() - t0).count();
  };
  arrival_->start(std::move(ends), std::move(step_tile));
}

OffloadTimes PartitionedOptimizer::last_offload_times() const {
  auto times = offload_times_;
  if (arrival_ && arrival_->in_flight() && !(speculative_ && speculative_->committed()))
    times.step_ms = overlapped_step_ms_;  // the last overlapped step its worker finished
  return times;
}

void PartitionedOptimizer::settle() {
  if (!arrival_ || !arrival_->in_flight()) return;
  torch::NoGradGuard no_grad;
  std::exception_ptr failure;
  try {
    arrival_->finish();
    if (speculative_ && speculative_->committed()) {  // the tiles it delivered were speculated
      speculative_->finish();
      offload_times_.step_ms = speculative_->last_step_ms();
      // Its copies out of spec_out_ may still be queued: the next speculation waits for them.
      spec_out_free_ = arrival_->copies_done();
    } else {
      offload_times_.step_ms = overlapped_step_ms_;
    }
  } catch (...) {
    failure = std::current_exception();
  }
  zero_gradients();  // the step read them until now
  if (failure) std::rethrow_exception(failure);
}

void PartitionedOptimizer::begin_speculation(double loss_scale) {
  torch::NoGradGuard no_grad;
  const int64_t n = shards_.partition_numel();
  const auto dtype = flat_ ? flat_->data().scalar_type() : units_->partition().scalar_type();
  if (!speculative_) {
    std::vector<SpeculativeStep::Item> items;  // the CPU's: the device share is not speculated
    for (const auto& t : step_items())
      if (!in_device_share(t.part)) items.push_back(t);
    speculative_ = std::make_unique<SpeculativeStep>(std::move(items));
    spec_out_ = host_buffer(n, dtype);
  }
  if (options_.stage <= 1 && !host_grad_.defined())
    throw Error("super_offload: stage 1 keeps no host gradient buffer here");
  // The step's numbers as they will be if nothing clips: prepare()'s factor with no clipping.
  const auto adam = overlapped_step_(options_.gradient_factor / loss_scale, /*advance=*/false);
  SpeculativeStep::Arrays a;
  a.master = master_;
  a.exp_avg = adam.exp_avg;
  a.exp_avg_sq = adam.exp_avg_sq;
  a.grad = options_.stage >= 2 && host_accum_.defined() ? host_accum_ : host_grad_;
  if (options_.stage >= 2 && host_accum_.defined()) a.arriving = host_grad_;
  a.out = spec_out_;
  // The caller's thread keeps a core to run backward on a GPU meanwhile.
  const int threads = std::max(1, at::get_num_threads() - (device_.is_cuda() ? 1 : 0));
  speculative_->begin(a, adam.scalars, threads, std::move(spec_out_free_));
  spec_out_free_ = nullptr;
  ++offload_times_.speculated;
}

void PartitionedOptimizer::arrive_stage1_gradient() {
  // Stage 1 reduces whole gradients at the end of backward: the pieces go to host memory now.
  if (!accumulates_wide()) own_local_gradients();
  const auto gradient = partition_gradient();
  for (const auto& item : speculative_->items())
    speculative_->arrive(item.part, item.n,
                         copy_to_host_tracked(host_grad_.narrow(0, item.part, item.n),
                                              gradient.narrow(0, item.part, item.n)));
}

namespace {

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// Every number the step uses, compared bit for bit.
bool same_scalars(const optim::AdamScalars& a, const optim::AdamScalars& b) {
  return same_bits(a.grad_scale, b.grad_scale) && same_bits(a.lr, b.lr) &&
         same_bits(a.beta1, b.beta1) && same_bits(a.beta2, b.beta2) && same_bits(a.eps, b.eps) &&
         same_bits(a.weight_decay, b.weight_decay) &&
         same_bits(a.one_minus_beta1, b.one_minus_beta1) &&
         same_bits(a.one_minus_beta2, b.one_minus_beta2) &&
         same_bits(a.decay_factor, b.decay_factor) && same_bits(a.step_size, b.step_size) &&
         same_bits(a.sqrt_c2, b.sqrt_c2) && a.adam_w_mode == b.adam_w_mode;
}

}  // namespace

bool PartitionedOptimizer::commit_speculation(double clip_coef, const torch::Tensor& mine) {
  const double scale = grad_scale_ * std::min(clip_coef, 1.0);
  if (!same_scalars(overlapped_step_(scale, /*advance=*/false).scalars, speculative_->assumed())) {
    // Clipping applied, or the learning rate (or another number) changed since backward began:
    // the ordinary step runs from the state the speculation left untouched.
    speculative_->cancel();
    ++offload_times_.redone;
    return false;
  }
  const auto adam = overlapped_step_(scale, /*advance=*/true);  // counts the step
  speculative_->commit();
  step_device_share(adam.scalars, mine);  // the device share is stepped now, on the device
  if (!mine.defined()) {
    // One partition of the flat buffer: each tile goes to the device as soon as it is stepped,
    // and the next forward's ops wait for the tiles they read (weight_arrival.h). The device
    // share's tiles (the lowest) are in place already.
    const auto& flat = flat_->data();
    if (!arrival_) arrival_ = std::make_unique<WeightArrival>(flat);
    auto tiles = step_items();
    std::vector<int64_t> ends, speculated;  // speculated[k]: tile k's item in the speculation
    int64_t next = 0;
    for (const auto& t : tiles) {
      ends.push_back(t.flat + t.n);
      speculated.push_back(in_device_share(t.part) ? -1 : next++);
    }
    auto deliver = [this, flat, out = spec_out_, tiles = std::move(tiles),
                    speculated = std::move(speculated)](size_t k) {
      if (speculated[k] < 0) return;
      const auto& t = tiles[k];
      speculative_->wait_item(size_t(speculated[k]));
      flat.narrow(0, t.flat, t.n).copy_(out.narrow(0, t.part, t.n), /*non_blocking=*/out.is_pinned());
    };
    arrival_->start(std::move(ends), std::move(deliver));
    return true;
  }
  speculative_->finish();
  offload_times_.step_ms = speculative_->last_step_ms();
  for (const auto& t : speculative_->items()) send_weights(mine, t.part, t.n);
  spec_out_free_ = queued_work_done(device_);  // those copies may be asynchronous
  return true;
}

void PartitionedOptimizer::send_weights(const torch::Tensor& mine, int64_t lo, int64_t n) {
  const auto from = spec_out_.narrow(0, lo, n);
  if (units_ && units_->partition_offload() != "none") {
    const auto host_params = units_->writable_host_partition();
    if (host_params.defined())
      host_params.narrow(0, lo, n).copy_(from);
    else  // to the parameters' swap file
      units_->write_partition(lo, from);
    return;
  }
  mine.narrow(0, lo, n).copy_(from, /*non_blocking=*/from.is_pinned());
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
