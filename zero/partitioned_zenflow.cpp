// PartitionedOptimizer's ZenFlow step (zero_optimization.zenflow, docs/zenflow.md): on one
// partition at stages 1-2 with the optimizer offloaded, the selected elements (the top columns of
// each weight's gradient, every 1-D parameter) are stepped on the device at every step with
// their own fp32 master and moments, the rest by the CPU Adam every update_interval steps on the
// window's mean gradient. The gradient, the window's sum and the columns' scores stay on the
// device; the sum crosses to host memory once per window. The host master and moments keep the
// whole partition's shape; for the selected elements they are written back from the device when
// the selection changes, so a selection hands its state over instead of dropping it (DeepSpeed
// zeroes the moments and rounds the master to 16 bits there).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>

#include <fmt/format.h>

#include "offload/cpu_adam.h"
#include "runtime/error.h"
#include "runtime/util/clock.h"
#include "zero/host_copy.h"
#include "zero/partitioned_optimizer.h"

namespace strata::zero {

void PartitionedOptimizer::clear_zenflow_selection() {
  auto& z = *zenflow_;
  const auto i64 = torch::TensorOptions().dtype(torch::kLong);
  z.part_index = torch::empty({0}, i64);
  z.device_index = z.flat_index = torch::empty({0}, i64.device(device_));
  z.master = z.exp_avg = z.exp_avg_sq = torch::Tensor();
}

void PartitionedOptimizer::zenflow_select(const AdamTiles& adam) {
  auto& z = *zenflow_;
  settle_zenflow();  // an overlapped CPU update writes the host arrays
  zenflow_hand_back(adam);  // the leaving selection's state (current: the device stepped it)
  // The new one, from this step's gradient: per weight [rows, columns] (trailing dimensions
  // flattened), the columns of largest L1 norm; 1-D parameters whole. A rank scores the columns
  // by the rows of them its partition holds (all of them on one rank) and selects
  // max(1, floor(topk_ratio x columns)) of those it holds anything of.
  const double ratio = options_.zenflow.topk_ratio;
  const auto i64 = torch::TensorOptions().dtype(torch::kLong).device(device_);
  std::vector<torch::Tensor> parts, flats;
  int64_t columns = 0;
  const auto& params = flat_->params();
  const auto& pieces = shards_.pieces(partition_index());
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].numel(), fo = flat_->offset(i);
    // The parameter's elements in this partition: flat [a, b) at partition offset a + shift.
    std::vector<torch::Tensor> flat_at, part_at;
    for (const auto& piece : pieces) {
      const int64_t a = std::max(fo, piece.flat_begin);
      const int64_t b = std::min(fo + n, piece.flat_begin + piece.length);
      if (a >= b) continue;
      flat_at.push_back(torch::arange(a, b, i64));
      part_at.push_back(flat_at.back() + (piece.offset - piece.flat_begin));
    }
    if (flat_at.empty()) continue;
    auto flat_here = torch::cat(flat_at), part_here = torch::cat(part_at);
    if (params[i].dim() >= 2 && ratio < 1.0) {
      const int64_t cols = n / params[i].size(0);
      const auto col = (flat_here - fo).remainder(cols);
      auto scores = torch::zeros({cols}, grad_.options().dtype(torch::kFloat));
      scores.index_add_(0, col, grad_.index_select(0, part_here).abs().to(torch::kFloat));
      const auto held = torch::zeros({cols}, torch::TensorOptions().dtype(torch::kBool).device(device_))
                            .index_fill_(0, col, true);
      const int64_t candidates = held.sum().item<int64_t>();
      const int64_t k = std::min(candidates, std::max<int64_t>(1, int64_t(ratio * double(cols))));
      // Columns it holds nothing of rank last (their score would tie at zero).
      scores.masked_fill_(held.logical_not(), -1.0f);
      const auto picked = torch::zeros({cols}, held.options()).index_fill_(0, std::get<1>(scores.topk(k)), true);
      const auto keep = picked.index_select(0, col);
      flat_here = flat_here.masked_select(keep);
      part_here = part_here.masked_select(keep);
      columns += k;
    } else if (params[i].dim() >= 2) {
      columns += n / params[i].size(0);
    }
    parts.push_back(part_here);
    flats.push_back(flat_here);
  }
  z.columns = columns;
  if (parts.empty()) {
    clear_zenflow_selection();
    return;
  }
  z.device_index = torch::cat(parts);
  z.part_index = z.device_index.cpu();
  z.flat_index = torch::cat(flats);
  zenflow_take(adam);
}

void PartitionedOptimizer::zenflow_hand_back(const AdamTiles& adam) {
  const auto& z = *zenflow_;
  if (z.part_index.numel() == 0 || !z.master.defined()) return;
  master_.index_copy_(0, z.part_index, z.master.cpu());
  adam.exp_avg.index_copy_(0, z.part_index, z.exp_avg.cpu());
  adam.exp_avg_sq.index_copy_(0, z.part_index, z.exp_avg_sq.cpu());
}

void PartitionedOptimizer::zenflow_take(const AdamTiles& adam) {
  auto& z = *zenflow_;
  if (z.part_index.numel() == 0) return;
  z.master = master_.index_select(0, z.part_index).to(device_);
  z.exp_avg = adam.exp_avg.index_select(0, z.part_index).to(device_);
  z.exp_avg_sq = adam.exp_avg_sq.index_select(0, z.part_index).to(device_);
}

void PartitionedOptimizer::apply_zenflow(double clip_coef, const torch::Tensor& mine) {
  auto& z = *zenflow_;
  const auto& o = options_.zenflow;
  const int64_t t = z.steps++;
  if (t < o.warm_up) {  // full_warm_up_rounds: the plain offloaded step, from host memory
    if (!host_grad_.defined()) host_grad_ = host_buffer(grad_.numel(), grad_.scalar_type());
    host_grad_.copy_(grad_);
    grad_ = host_grad_;
    apply_offloaded(clip_coef, mine);
    if (!shards_.is_contiguous()) shards_.scatter(mine, partition_index(), flat_->data());
    return;
  }
  host_grad_ = torch::Tensor();  // the warm-up's host copy of the gradient, needed no more
  if (!device_step_ || !overlapped_step_)
    throw Error("zero_optimization.zenflow steps Strata's Adam/AdamW on the device and on the "
                "CPU (optimizer.type \"Adam\" or \"AdamW\", one param group)");
  const auto t0 = std::chrono::steady_clock::now();
  const double factor = grad_scale_ * std::min(clip_coef, 1.0);
  const auto adam = overlapped_step_(factor, /*advance=*/true);  // this step's scalars
  const bool select = t == o.warm_up || (o.select_interval > 0 && (t - o.warm_up) % o.select_interval == 0);
  if (select) zenflow_select(adam);
  auto& flat = flat_->data();
  // The selected elements, on the device, with this step's gradient.
  if (z.part_index.numel() > 0) {
    const auto g = grad_.index_select(0, z.device_index);
    auto out = torch::empty({z.part_index.numel()}, flat.options());
    device_step_(z.master, z.exp_avg, z.exp_avg_sq, g, out, adam.scalars);
    flat.index_copy_(0, z.flat_index, out);
  }
  // The rest: summed over the window (clipped and unscaled step by step), stepped by the CPU at
  // its end, and before every reselection (the arriving columns' host state is then current).
  z.sum.add_(grad_, factor);
  ++z.window;
  const bool reselect_next =
      o.select_interval > 0 && (t + 1 - o.warm_up) % o.select_interval == 0;
  if (z.window >= o.update_interval || reselect_next) {
    auto s = adam.scalars;
    s.grad_scale = float(1.0 / double(z.window));
    install_zenflow_update(mine);  // the last window's, when it ran overlapped
    z.pending_steps = z.window;
    z.window = 0;
    if (o.overlap && !reselect_next) {
      // overlap_step: this window's sum crosses on the copy stream and the CPU steps it on a
      // worker while the next window trains, summing into the other buffer; its new weights are
      // installed at that window's end (the unselected columns one window staler, as DeepSpeed).
      // The worker first waits for the sum's copy and for the last install's copies out of
      // host_out_, which it overwrites.
      auto copied = copy_to_host_tracked(z.host_sum, z.sum);
      auto out_free = queued_work_done(device_);
      std::swap(z.sum, z.spare);
      z.sum.zero_();  // the window before last's: its copy was waited for by its worker
      const int threads = std::max(
          1, int(std::lround(at::get_num_threads() * (1.0 - o.reserved_cores))));
      z.worker = std::async(std::launch::async, [this, adam, s, threads, copied, out_free] {
        const auto w0 = std::chrono::steady_clock::now();
        if (copied) copied();
        if (out_free) out_free();
        zenflow_->copy_wait_ms = ms_since(w0);
        zenflow_cpu_update(adam, s, threads);
        zenflow_stage_update();
      });
    } else {
      z.host_sum.copy_(z.sum);
      z.copy_wait_ms = 0;
      zenflow_cpu_update(adam, s, at::get_num_threads());
      z.sum.zero_();
      count_zenflow_update(0.0);
    }
    z.pending = true;
    if (!o.overlap || reselect_next) install_zenflow_update(mine);
  }
  offload_times_.step_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  offload_times_.zenflow_columns = z.columns;
  offload_times_.zenflow_device_elements = z.part_index.numel();
  offload_times_.zenflow_stale_steps = z.window + (z.pending ? z.pending_steps : 0);
}

void PartitionedOptimizer::zenflow_cpu_update(const AdamTiles& adam, const optim::AdamScalars& s,
                                              int threads) {
  auto& z = *zenflow_;
  const auto t0 = std::chrono::steady_clock::now();
  const auto out_type = host_float(host_out_);
  const int64_t out_size = host_out_.element_size();
  // Every element: the selected ones' host state is the device's to overwrite when they leave,
  // and their new weights are the device's, put back at the install.
  for (const auto& item : step_items())
    offload::cpu_adam_step(master_.data_ptr<float>() + item.part,
                           adam.exp_avg.data_ptr<float>() + item.part,
                           adam.exp_avg_sq.data_ptr<float>() + item.part,
                           z.host_sum.data_ptr<float>() + item.part, offload::Float::kF32,
                           static_cast<char*>(host_out_.data_ptr()) + item.part * out_size,
                           out_type, item.n, s, threads);
  z.cpu_ms = ms_since(t0);
}

torch::Tensor PartitionedOptimizer::zenflow_staging() const {
  const auto& z = *zenflow_;
  return z.spare.view(host_out_.scalar_type()).narrow(0, 0, host_out_.numel());
}

void PartitionedOptimizer::zenflow_stage_update() {
  // On the worker: the new weights cross on the copy stream while the window trains, into
  // `spare` (its sum crossed before the CPU update began; it is summed into again only after
  // the install). A CPU device: the install copies from host_out_.
  auto& z = *zenflow_;
  SideStream side(device_, SideStream::Direction::kToDevice);
  if (!side.active() || !host_out_.is_pinned()) return;
  zenflow_staging().copy_(host_out_, /*non_blocking=*/true);
  z.staged = side.done();
}

void PartitionedOptimizer::count_zenflow_update(double stall_ms) {
  const auto& z = *zenflow_;
  offload_times_.zenflow_stall_ms += stall_ms;
  offload_times_.zenflow_cpu_ms = z.cpu_ms;
  offload_times_.zenflow_copy_wait_ms = z.copy_wait_ms;
  ++offload_times_.zenflow_updates;
}

void PartitionedOptimizer::settle_zenflow() {
  if (!zenflow_ || !zenflow_->worker.valid()) return;
  const auto t0 = std::chrono::steady_clock::now();
  zenflow_->worker.get();  // rethrows the CPU update's failure
  // The compute stream reads or rewrites `spare` only after the staged copy into it.
  if (zenflow_->staged) zenflow_->staged->wait();
  count_zenflow_update(ms_since(t0));
}

void PartitionedOptimizer::install_zenflow_update(const torch::Tensor& mine) {
  auto& z = *zenflow_;
  if (!z.pending) return;
  settle_zenflow();
  if (z.staged)
    mine.copy_(zenflow_staging());
  else
    mine.copy_(host_out_, /*non_blocking=*/host_out_.is_pinned());
  z.staged = nullptr;
  // Stage 2's partition is laid out bucket by bucket: the CPU's new weights go into a buffer
  // scattered into the flat layout (stage 1's partition is a range of it, written in place).
  if (!shards_.is_contiguous()) shards_.scatter(mine, partition_index(), flat_->data());
  auto& flat = flat_->data();
  if (z.part_index.numel() > 0) flat.index_copy_(0, z.flat_index, z.master.to(flat.scalar_type()));
  z.pending = false;
  z.pending_steps = 0;
}

std::optional<PartitionedOptimizer::ZenFlowCheckpoint> PartitionedOptimizer::zenflow_checkpoint() const {
  if (!zenflow_) return std::nullopt;
  const auto& z = *zenflow_;
  ZenFlowCheckpoint c;
  c.steps = z.steps;
  c.window = z.window;
  c.columns = z.columns;
  c.pending_steps = z.pending ? z.pending_steps : 0;
  c.sum = z.sum.cpu();
  c.selected = torch::zeros({shards_.partition_numel()}, torch::kFloat);
  if (z.part_index.numel() > 0) c.selected.index_fill_(0, z.part_index, 1.0);
  return c;
}

void PartitionedOptimizer::restore_zenflow(const ZenFlowCheckpoint& saved) {
  if (!zenflow_) return;
  settle_zenflow();
  auto& z = *zenflow_;
  z.steps = saved.steps;
  z.window = saved.window;
  z.columns = saved.columns;
  if (!saved.sum.defined()) {  // none saved: ZenFlow starts afresh
    z.sum.zero_();
    z.pending = false;
    z.pending_steps = 0;
    clear_zenflow_selection();
    return;
  }
  z.sum.copy_(saved.sum);
  if (z.spare.defined()) z.spare.zero_();
  // An overlapped update applied to the saved master and moments and not installed yet: its new
  // weights are the master's, installed at the window's end as the straight run does.
  z.pending = saved.pending_steps > 0;
  z.pending_steps = saved.pending_steps;
  z.staged = nullptr;  // the pending weights come from host_out_ (below)
  if (z.pending) host_out_.copy_(master_.view({-1}));  // allocated with ZenFlow's state
  z.part_index = saved.selected.nonzero().reshape({-1});  // ascending: each element's state goes by its index
  z.device_index = z.part_index.to(device_);
  // Each selected partition element's place in the flat buffer, piece by piece.
  auto flat = z.part_index.clone();
  for (const auto& piece : shards_.pieces(partition_index())) {
    const auto in = z.part_index.ge(piece.offset).logical_and(z.part_index.lt(piece.offset + piece.length));
    flat.masked_scatter_(in, z.part_index.masked_select(in) - piece.offset + piece.flat_begin);
  }
  z.flat_index = flat.to(device_);
  // The columns this rank's selection touches (the saved count is rank 0's, of its old cut).
  z.columns = 0;
  const auto& params = flat_->params();
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].dim() < 2) continue;
    const int64_t fo = flat_->offset(i), n = params[i].numel();
    const auto in = flat.ge(fo).logical_and(flat.lt(fo + n));
    z.columns += std::get<0>(at::_unique((flat.masked_select(in) - fo).remainder(n / params[i].size(0)))).numel();
  }
  z.master = z.exp_avg = z.exp_avg_sq = torch::Tensor();  // load_device_share() reads them
}

}  // namespace strata::zero
