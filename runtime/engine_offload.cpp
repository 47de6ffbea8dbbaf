// The engine's optimizer offload (offload_optimizer): CPU memory (ZeRO-Offload) or NVMe swap files
// through io_uring (ZeRO-Infinity), set up from the config; and the master state that
// checkpoints read and write, wherever it lives.
#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdlib>
#include <typeinfo>

#include <fmt/format.h>

#include "offload/cpu_adam.h"
#include "runtime/engine.h"
#include "runtime/error.h"
#include "runtime/log.h"
#include "runtime/master_state.h"
#include "runtime/optim/adam.h"

namespace strata {
namespace {

using Swap = offload::OptimizerSwapper;

offload::NvmeOptions nvme_options(const AioConfig& aio) {
  offload::NvmeOptions o;
  o.block_size = aio.block_size;
  o.queue_depth = static_cast<int>(aio.queue_depth);
  o.intra_op_parallelism = static_cast<int>(aio.intra_op_parallelism);
  o.single_submit = aio.single_submit;
  o.overlap_events = aio.overlap_events;
  return o;
}

// Names this job's swap folders (strata-<id>-rank<r>) apart from other jobs' under a shared
// nvme_path: STRATA_JOB_ID when the program or its scheduler sets it, else rank 0's process id,
// which every rank of the job receives.
std::string swap_job_id(const comm::GroupPtr& group, const torch::Device& device) {
  if (const char* id = std::getenv("STRATA_JOB_ID"); id && *id) return id;
  auto pid = torch::tensor({static_cast<int64_t>(getpid())}, torch::kLong).to(device);
  if (group) group->broadcast(pid, 0);
  return fmt::format("pid{}", pid.cpu().item<int64_t>());
}

}  // namespace

zero::OffloadOptions Engine::optimizer_offload_options() {
  const auto& zero = config_.zero_optimization;
  const auto& oo = zero.offload_optimizer;
  zero::OffloadOptions o;
  o.enabled = oo.device == "cpu" || oo.device == "nvme";
  o.pin_memory = oo.pin_memory;
  o.tile_numel = zero.sub_group_size;
  o.speculative = oo.super_offload;
  o.device_share = 1.0 - oo.ratio;
  if (oo.device != "nvme") return o;
  // The schema allows NVMe at stage 3 only (as DeepSpeed). One store: MoE experts' optimizer
  // keeps its files beside the others' under its own swap name.
  nvme_store_ = make_nvme_store(oo.nvme_path);
  o.nvme = nvme_store_;
  o.pipeline_read = oo.pipeline_read;
  o.pipeline_write = oo.pipeline_write;
  o.host_budget = std::make_shared<int64_t>(oo.max_in_cpu);
  return o;
}

std::shared_ptr<offload::NvmeStore> Engine::make_nvme_store(const std::string& nvme_path) {
  // One store per folder: a second store of the same job and rank under the same nvme_path
  // would take over (and remove) the first one's folder.
  if (nvme_store_) {
    char* a = realpath(nvme_path.c_str(), nullptr);
    char* b = realpath(config_.zero_optimization.offload_optimizer.nvme_path.c_str(), nullptr);
    const bool same = a && b && std::string(a) == b;
    std::free(a);
    std::free(b);
    if (same) return nvme_store_;
  }
  if (swap_job_id_.empty()) swap_job_id_ = swap_job_id(group_, device_);
  auto store = std::make_shared<offload::NvmeStore>(nvme_path, swap_job_id_, data_parallel_rank(),
                                                    nvme_options(config_.aio));
  for (const auto& folder : store->removed_abandoned())
    log::info("[strata] nvme store: removed '{}', left by a run that died before cleaning up",
              folder);
  nvme_stores_.push_back(store);
  return store;
}

offload::NvmeStore::Traffic Engine::nvme_traffic() const {
  offload::NvmeStore::Traffic sum;
  for (const auto& weak : nvme_stores_)
    if (const auto store = weak.lock()) {
      const auto t = store->traffic();
      sum.read_bytes += t.read_bytes;
      sum.written_bytes += t.written_bytes;
      sum.read_wait_s += t.read_wait_s;
      sum.write_wait_s += t.write_wait_s;
      sum.wait_all_s += t.wait_all_s;
    }
  return sum;
}

void Engine::offload_parameters() {
  const auto& op = config_.zero_optimization.offload_param;
  auto* units = dense().units();
  if (op.device == "none" || !units) return;
  auto* expert_units = expert_group() ? expert_group()->units() : nullptr;
  // With the optimizer offloaded too, its CPU step writes each tile of new weights to where the
  // shards live; else (as DeepSpeed allows at stage 3) the fp32 master and the optimizer state
  // stay on the device and each step stores the master, cast, to the shards' tier.
  const auto store = op.device == "nvme" ? make_nvme_store(op.nvme_path) : nullptr;
  units->offload_partition(op.device, op.pin_memory, store);
  if (expert_units) expert_units->offload_partition(op.device, op.pin_memory, store, "expert-params");
  log::info("[strata] parameter offload: this rank's {} trainable {} shard elements{} in {}; "
            "each unit is {} for its gather; {}",
            units->partition().numel(), c10::toString(units->partition().scalar_type()),
            expert_units ? fmt::format(" (and {} of MoE experts)", expert_units->partition().numel())
                         : std::string(),
            op.device == "cpu" ? (units->partition().is_pinned() ? "page-locked host memory"
                                                                 : "host memory")
                               : "an NVMe swap file under " + op.nvme_path,
            op.device == "cpu" ? "copied to the device" : "read back",
            dense().partitioned()->offloads()
                ? "the offloaded optimizer's step writes the new weights there"
                : fmt::format("the fp32 master and the optimizer state stay on the {} (no "
                              "offload_optimizer), and each step stores the new weights there",
                              device_.str()));
}

void Engine::finish_optimizer_offload() {
  const auto* dense_partitioned = dense().partitioned();
  if (!dense_partitioned || !dense_partitioned->offloads()) return;
  const auto& zero = config_.zero_optimization;
  int64_t numel = 0;
  for (const auto& g : groups_) numel += g->partitioned()->master().numel();
  // What each group's optimizer is to the user: the experts' comes from its own builder.
  auto whose = [this](const ParamGroup& g, const char* dense_name) {
    return &g == expert_group() ? "the MoE experts' optimizer (InitOptions::expert_optimizer_builder)"
                                : dense_name;
  };
  if (dense_partitioned->swaps()) {
    // Both partitioned optimizers (the experts' too) stream Strata's Adam through the files.
    auto use_swapped_adam = [&](zero::PartitionedOptimizer& partitioned,
                                const std::shared_ptr<torch::optim::Optimizer>& optimizer,
                                const char* whose) {
      auto adam = std::dynamic_pointer_cast<optim::Adam>(optimizer);
      if (!adam || !adam->can_step_flat())
        throw Error(fmt::format(
            "{}: zero_optimization.offload_optimizer.device \"nvme\" steps Strata's Adam/AdamW "
            "(optimizer.type \"Adam\" or \"AdamW\", one param group), whose state it streams "
            "through the swap files; {} keeps state the swapper does not know. Use Adam/AdamW, "
            "or offload_optimizer.device \"cpu\"",
            config_.source, whose));
      partitioned.use_swapped_step([adam](double scale) { return adam->next_flat_scalars(scale); });
    };
    for (const auto& g : groups_)
      use_swapped_adam(*g->partitioned(), g->optimizer(), whose(*g, "this optimizer"));
    const auto* swapper = dense_partitioned->swapper();
    int64_t resident = 0;
    for (const auto& g : groups_) resident += g->partitioned()->swapper()->resident_numel();
    log::info("[strata] optimizer offload to NVMe: fp32 master and Adam state of {} elements in "
              "swap files under {}{}{}, stepped on the CPU ({}, {} thread(s)) in tiles of {} "
              "elements (host buffers {} MB{}{}){}",
              numel - resident, nvme_store_->folder(), nvme_store_->direct() ? " (O_DIRECT)" : " (buffered)",
              resident > 0 ? fmt::format(" and of {} more in host memory (offload_optimizer.max_in_cpu, "
                                         "{:.2f} GB)", resident, 12.0 * double(resident) / 1e9)
                           : std::string(),
              offload::cpu_adam_isa(), at::get_num_threads(), swapper->tile_numel(),
              (6 * swapper->tile_numel() * 4) >> 20,
              zero.offload_optimizer.pipeline_read ? ", read ahead" : "",
              zero.offload_optimizer.pipeline_write ? ", written behind" : "",
              dense_partitioned->swaps_gradients()
                  ? "; gradients in a swap file too, written as backward reduces them"
                  : "");
    return;
  }
  // What steps the host master: Strata's SIMD Adam (DeepSpeedCPUAdam's counterpart) or the
  // optimizer itself, a LibTorch step over host tensors. A client's optimizer of the second kind
  // is refused unless zero_force_ds_cpu_optimizer is false, as DeepSpeed refuses it.
  auto stepper = [&](const std::shared_ptr<torch::optim::Optimizer>& optimizer, bool client,
                     const char* whose) -> std::string {
    auto adam = std::dynamic_pointer_cast<optim::Adam>(optimizer);
    if (adam && adam->can_step_flat())
      return fmt::format("Strata's SIMD CPU Adam ({}, {} thread(s))", offload::cpu_adam_isa(),
                         at::get_num_threads());
    const std::string type = c10::demangle(typeid(*optimizer).name());
    if (client && config_.zero_force_ds_cpu_optimizer)
      throw Error(fmt::format(
          "{}: zero_optimization.offload_optimizer.device \"cpu\" with a client optimizer ({}, {}): "
          "its step would run as LibTorch code over the host master, not in Strata's SIMD CPU Adam "
          "(DeepSpeed's DeepSpeedCPUAdam), which in most cases is much slower. Name the optimizer "
          "in the config (\"optimizer\": {{\"type\": \"AdamW\", ...}}), or set "
          "\"zero_force_ds_cpu_optimizer\": false to step this optimizer on the CPU anyway",
          config_.source, whose, type));
    return fmt::format("{}'s own step (LibTorch, {} thread(s); not Strata's SIMD Adam)", type,
                       at::get_num_threads());
  };
  // super_offload speculates Strata's Adam: its numbers can be taken before the step and its
  // state is two flat arrays the speculation can keep a second set of. A ratio below 1 steps a
  // share of that state on the device with the same numbers.
  for (const auto& g : groups_) {
    auto adam = std::dynamic_pointer_cast<optim::Adam>(g->optimizer());
    const bool strata_adam = adam && adam->can_step_flat();
    if (zero.offload_optimizer.super_offload && !strata_adam)
      throw Error(fmt::format(
          "{}: zero_optimization.offload_optimizer.super_offload speculates Strata's CPU Adam "
          "(optimizer.type \"Adam\" or \"AdamW\", one param group); {} is another optimizer. "
          "Use Adam/AdamW, or set super_offload false",
          config_.source, whose(*g, "this optimizer")));
    const auto range = g->partitioned()->device_range();
    if (range.second > range.first && !strata_adam)
      throw Error(fmt::format(
          "{}: zero_optimization.offload_optimizer.ratio {} keeps a share of the optimizer on the "
          "device, stepped by Strata's fused Adam (optimizer.type \"Adam\" or \"AdamW\"); {} is "
          "another optimizer. Use Adam/AdamW, or set ratio 1",
          config_.source, zero.offload_optimizer.ratio, whose(*g, "this optimizer")));
  }
  // Without an "optimizer" block the optimizers are the program's (InitOptions).
  const bool client = !config_.optimizer.present;
  std::string steps;
  for (const auto& g : groups_)
    steps += (steps.empty() ? "" : "; MoE experts: ") +
             stepper(g->optimizer(), client,
                     g.get() == expert_group() ? "InitOptions::expert_optimizer_builder"
                                               : "InitOptions::optimizer_builder");
  log::info("[strata] optimizer offload: fp32 master and optimizer state of {} elements in host "
            "memory{}, stepped on the CPU by {} in tiles of up to {} elements{}{}{}",
            numel,
            dense_partitioned->pinned_host_bytes() > 0 ? ", transfers through page-locked buffers" : "",
            steps, zero.sub_group_size,
            dense_partitioned->overlaps_step()
                ? "; each step overlaps the next forward, whose ops wait for the tiles they read"
                : "",
            dense_partitioned->device_range().second > dense_partitioned->device_range().first
                ? fmt::format("; ratio {}: {} of this rank's partition elements keep their master "
                              "and moments on the {} and step there",
                              zero.offload_optimizer.ratio,
                              dense_partitioned->device_range().second -
                                  dense_partitioned->device_range().first,
                              device_.str())
                : "",
            dense_partitioned->speculates()
                ? "; super_offload: each step starts during backward, speculatively, as gradients "
                  "land (a second fp32 master and moments in host memory; steps that clipping, an "
                  "overflow or a new learning rate invalidates are redone exactly)"
                : "");
}

bool write_master_state(const zero::PartitionedOptimizer& partitioned,
                        const torch::optim::Optimizer& optimizer, checkpoint::TensorFileWriter& out,
                        json& scalars) {
  if (!partitioned.swaps()) {
    out.add("master", partitioned.master());
    const auto state = optim::export_param_state(optimizer, partitioned.master());
    if (!state) return false;
    scalars["state.type"] = state->type;
    for (const auto& item : state->scalars.items()) scalars["state." + item.key()] = item.value();
    for (const auto& [name, t] : state->tensors) out.add("state." + name, t);
    return true;
  }
  // Swapped state is Strata's Adam's (finish_optimizer_offload checked it): the step count is in
  // the optimizer, the arrays in the files, copied into the checkpoint tile by tile.
  const auto& adam = dynamic_cast<const optim::Adam&>(optimizer);
  const int64_t numel = partitioned.master().numel();
  auto stream = [&](const std::string& name, Swap::Array a) {
    out.begin({name, torch::kFloat, {numel}});
    partitioned.read_swapped_tiles(a, [&](int64_t, int64_t n, const float* src) {
      out.write(src, size_t(n) * sizeof(float));
    });
    out.end();
  };
  stream("master", Swap::kMaster);
  stream("state.exp_avg", Swap::kExpAvg);
  stream("state.exp_avg_sq", Swap::kExpAvgSq);
  scalars["state.type"] = "adam";
  scalars["state.step"] = adam.flat_steps();
  return true;
}

optim::ParamState saved_state_header(const json& scalars, const std::vector<std::string>& names,
                                     const torch::Tensor& master) {
  optim::ParamState state;
  state.type = scalars.at("state.type").get<std::string>();
  if (scalars.contains("state.step")) state.scalars["step"] = scalars.at("state.step");
  const auto shaped = torch::zeros({1}, torch::kFloat).expand(master.sizes());
  for (const auto& name : names)
    if (name.rfind("state.", 0) == 0 && name.find('.', 6) == std::string::npos)
      state.tensors.emplace_back(name.substr(6), shaped);
  return state;
}

void install_master_state(zero::PartitionedOptimizer& partitioned,
                          torch::optim::Optimizer& optimizer, const PartitionSource& source,
                          const optim::ParamState& header) {
  torch::NoGradGuard no_grad;
  const int64_t numel = partitioned.master().numel();
  if (!partitioned.swaps()) {
    // The master is in memory already: the saved arrays are read straight into it and into the
    // state's own tensors (those the optimizer holds when they fit, else new ones it keeps), so
    // that no array exists twice (issue 60: the largest models fill host memory with them).
    const auto& master = partitioned.master();
    auto fill = [&](const std::string& name, const torch::Tensor& dst) {
      if (dst.device().is_cpu() && dst.scalar_type() == torch::kFloat && dst.is_contiguous()) {
        source(name, 0, numel, dst.data_ptr<float>());
        return;
      }
      // On a device: through one bounded host buffer.
      const int64_t tile = std::min<int64_t>(numel, int64_t(1) << 22);
      auto staging = torch::empty({tile}, torch::kFloat);
      auto flat = dst.view({-1});
      for (int64_t o = 0; o < numel; o += tile) {
        const int64_t n = std::min(tile, numel - o);
        source(name, o, n, staging.data_ptr<float>());
        flat.narrow(0, o, n).copy_(staging.narrow(0, 0, n));
      }
    };
    fill("master", master);
    const auto live = optim::export_param_state(optimizer, master);
    optim::ParamState state = header;
    for (auto& [name, t] : state.tensors) {
      torch::Tensor into;
      if (live && live->type == header.type)
        for (const auto& [n, held] : live->tensors)
          if (n == name && held.sizes() == master.sizes() &&
              held.scalar_type() == master.scalar_type() && held.device() == master.device() &&
              held.is_contiguous())
            into = held;
      if (!into.defined()) into = torch::empty_like(master);
      fill("state." + name, into);
      t = into;
    }
    optim::import_param_state(optimizer, master, state, /*copy=*/false);
    return;
  }
  auto& adam = dynamic_cast<optim::Adam&>(optimizer);
  auto stream = [&](const std::string& name, Swap::Array a) {
    partitioned.write_swapped_tiles(a, [&](int64_t offset, int64_t n, float* dst) {
      source(name, offset, n, dst);
    });
  };
  stream("master", Swap::kMaster);
  if (header.type == "none") {  // saved before the first step
    partitioned.fill_swapped(Swap::kExpAvg, 0.f);
    partitioned.fill_swapped(Swap::kExpAvgSq, 0.f);
    adam.set_flat_steps(0);
    return;
  }
  for (const auto& [name, t] : header.tensors) {
    if (name == "exp_avg") stream("state.exp_avg", Swap::kExpAvg);
    if (name == "exp_avg_sq") stream("state.exp_avg_sq", Swap::kExpAvgSq);
  }
  adam.set_flat_steps(header.scalars.at("step").get<int64_t>());
}

}  // namespace strata
