// PartitionedOptimizer's ZenFlow step (zero_optimization.zenflow, docs/zenflow.md): on one
// partition at stages 1-2 with the optimizer offloaded, the selected elements (the top columns of
// each weight's gradient, every 1-D parameter) are stepped on the device at every step with
// their own fp32 master and moments, the rest by the CPU Adam every update_interval steps on the
// window's mean gradient. The host master and moments keep the whole partition's shape; for the
// selected elements they are written back from the device when the selection changes, so a
// selection hands its state over instead of dropping it (DeepSpeed zeroes the moments and rounds
// the master to 16 bits there).
#include <algorithm>
#include <chrono>

#include <fmt/format.h>

#include "offload/cpu_adam.h"
#include "runtime/error.h"
#include "zero/host_copy.h"
#include "zero/partitioned_optimizer.h"

namespace strata::zero {

int64_t PartitionedOptimizer::partition_offset(int64_t flat_offset) const {
  if (shards_.is_contiguous()) return flat_offset;  // stage 1, one partition: the identity
  for (const auto& b : shards_.buckets())
    if (flat_offset >= b.lo && flat_offset < b.hi) return b.base + (flat_offset - b.lo);
  throw Error(fmt::format("ZenFlow: flat element {} is in no gradient bucket", flat_offset));
}

void PartitionedOptimizer::zenflow_select(const AdamTiles& adam) {
  auto& z = *zenflow_;
  // The leaving selection's state (current: the device stepped it) into the host arrays.
  if (z.part_index.numel() > 0) {
    master_.index_copy_(0, z.part_index, z.master.cpu());
    adam.exp_avg.index_copy_(0, z.part_index, z.exp_avg.cpu());
    adam.exp_avg_sq.index_copy_(0, z.part_index, z.exp_avg_sq.cpu());
  }
  // The new one, from this step's gradient: per weight [rows, columns] (trailing dimensions
  // flattened), the columns of largest L1 norm; 1-D parameters whole.
  const double ratio = options_.zenflow.topk_ratio;
  const auto i64 = torch::TensorOptions().dtype(torch::kLong);
  std::vector<torch::Tensor> parts, flats;
  int64_t columns = 0;
  const auto& params = flat_->params();
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].numel();
    if (n == 0) continue;
    const int64_t fo = flat_->offset(i), po = partition_offset(fo);
    torch::Tensor index;
    if (params[i].dim() < 2) {
      index = torch::arange(n, i64);
    } else {
      const int64_t rows = params[i].size(0), cols = n / rows;
      const int64_t k = ratio >= 1.0 ? cols
                        : ratio <= 0.0 ? 0
                                       : std::max<int64_t>(1, int64_t(ratio * double(cols)));
      if (k == 0) continue;
      torch::Tensor picked = torch::arange(cols, i64);
      if (k < cols) {
        const auto scores = grad_.narrow(0, po, n).view({rows, cols}).abs().sum(0, false, torch::kFloat);
        picked = std::get<0>(std::get<1>(scores.topk(k)).sort());
      }
      index = ((torch::arange(rows, i64) * cols).unsqueeze(1) + picked.unsqueeze(0)).reshape({-1});
      columns += k;
    }
    parts.push_back(index + po);
    flats.push_back(index + fo);
  }
  z.columns = columns;
  if (parts.empty()) {
    z.part_index = torch::empty({0}, i64);
    z.flat_index = torch::empty({0}, i64.device(device_));
    z.master = z.exp_avg = z.exp_avg_sq = torch::Tensor();
    return;
  }
  z.part_index = torch::cat(parts);
  z.flat_index = torch::cat(flats).to(device_);
  z.master = master_.index_select(0, z.part_index).to(device_);
  z.exp_avg = adam.exp_avg.index_select(0, z.part_index).to(device_);
  z.exp_avg_sq = adam.exp_avg_sq.index_select(0, z.part_index).to(device_);
}

void PartitionedOptimizer::apply_zenflow(double clip_coef, const torch::Tensor& mine) {
  auto& z = *zenflow_;
  const auto& o = options_.zenflow;
  // Stage 2's partition is laid out bucket by bucket: the CPU's new weights go into a buffer
  // scattered into the flat layout (stage 1's partition is a range of it, written in place).
  auto place = [&] {
    if (!shards_.is_contiguous()) shards_.scatter(mine, 0, flat_->data());
  };
  const int64_t t = z.steps++;
  if (t < o.warm_up) {  // full_warm_up_rounds: the plain offloaded step
    apply_offloaded(clip_coef, mine);
    place();
    return;
  }
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
    const auto g = grad_.index_select(0, z.part_index).to(device_);
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
    if (!host_out_.defined()) host_out_ = host_buffer(mine.numel(), mine.scalar_type());
    const int threads = at::get_num_threads();
    const auto out_type = host_float(host_out_);
    const int64_t out_size = host_out_.element_size();
    // Every element: the selected ones' host state is the device's to overwrite when they
    // leave, and their new weights are the device's, put back below.
    for (const auto& item : step_items()) {
      offload::cpu_adam_step(master_.data_ptr<float>() + item.part,
                             adam.exp_avg.data_ptr<float>() + item.part,
                             adam.exp_avg_sq.data_ptr<float>() + item.part,
                             z.sum.data_ptr<float>() + item.part, offload::Float::kF32,
                             static_cast<char*>(host_out_.data_ptr()) + item.part * out_size,
                             out_type, item.n, s, threads);
      mine.narrow(0, item.part, item.n)
          .copy_(host_out_.narrow(0, item.part, item.n), /*non_blocking=*/host_out_.is_pinned());
    }
    place();
    if (z.part_index.numel() > 0) flat.index_copy_(0, z.flat_index, z.master.to(flat.scalar_type()));
    z.sum.zero_();
    z.window = 0;
  }
  offload_times_.step_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  offload_times_.zenflow_columns = z.columns;
  offload_times_.zenflow_device_elements = z.part_index.numel();
  offload_times_.zenflow_stale_steps = z.window;
}

std::optional<PartitionedOptimizer::ZenFlowCheckpoint> PartitionedOptimizer::zenflow_checkpoint() const {
  if (!zenflow_) return std::nullopt;
  const auto& z = *zenflow_;
  ZenFlowCheckpoint c;
  c.steps = z.steps;
  c.window = z.window;
  c.columns = z.columns;
  c.sum = z.sum;
  c.selected = torch::zeros({shards_.partition_numel()}, torch::kFloat);
  if (z.part_index.numel() > 0) c.selected.index_fill_(0, z.part_index, 1.0);
  return c;
}

void PartitionedOptimizer::restore_zenflow(const ZenFlowCheckpoint& saved) {
  if (!zenflow_) return;
  auto& z = *zenflow_;
  z.steps = saved.steps;
  z.window = saved.window;
  z.columns = saved.columns;
  if (!saved.sum.defined()) {  // none saved: ZenFlow starts afresh
    z.sum.zero_();
    z.part_index = torch::empty({0}, torch::kLong);
    z.flat_index = torch::empty({0}, torch::TensorOptions().dtype(torch::kLong).device(device_));
    z.master = z.exp_avg = z.exp_avg_sq = torch::Tensor();
    return;
  }
  z.sum.copy_(saved.sum);
  z.part_index = saved.selected.nonzero().reshape({-1});  // ascending: each element's state goes by its index
  // Each selected partition element's place in the flat buffer (one partition: stage 1's is the
  // same, stage 2's bucket by bucket).
  auto flat = z.part_index.clone();
  if (!shards_.is_contiguous())
    for (const auto& b : shards_.buckets()) {
      const auto in = z.part_index.ge(b.base).logical_and(z.part_index.lt(b.base + b.chunk));
      flat.masked_scatter_(in, z.part_index.masked_select(in) - b.base + b.lo);
    }
  z.flat_index = flat.to(device_);
  z.master = z.exp_avg = z.exp_avg_sq = torch::Tensor();  // load_device_share() reads them
}

}  // namespace strata::zero
