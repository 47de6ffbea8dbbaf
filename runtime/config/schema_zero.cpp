// zero_optimization with offload_param / offload_optimizer (runtime/zero/config.py,
// runtime/zero/offload_config.py). Keys carry DeepSpeed's documented spelling; the pydantic field
// names (prefetch_bucket_size for stage3_prefetch_bucket_size, ...) are accepted as aliases.
#include <fmt/format.h>

#include "runtime/config/schema_blocks.h"

namespace strata::schema {
namespace {

const char* const kZeroTuning = "a tuning knob of DeepSpeed's own ZeRO implementation";

Block make_offload_param() {
  BlockBuilder<OffloadParamConfig> b("offload_param");
  b.add(&OffloadParamConfig::device, "device")
      .one_of({"none", "cpu", "nvme"}, true)
      .describe("Where parameters are offloaded at ZeRO-3: none, cpu or nvme");
  b.add(&OffloadParamConfig::nvme_path, "nvme_path")
      .describe("File-system path of the NVMe device parameters are offloaded to");
  b.add(&OffloadParamConfig::buffer_count, "buffer_count")
      .min(0)
      .ignored("Strata reads each unit's shard from NVMe into one bounce buffer and a copy on "
               "the device that lives while the unit is gathered")
      .describe("Buffers in the pool used to offload parameters to NVMe");
  b.add(&OffloadParamConfig::buffer_size, "buffer_size")
      .min(0)
      .ignored("the bounce buffer is sized by the largest unit's shard")
      .describe("Size (elements) of each buffer in the pool used to offload parameters to NVMe");
  b.add(&OffloadParamConfig::max_in_cpu, "max_in_cpu")
      .min(0)
      .ignored("Strata keeps no parameter cache in host memory with offload_param nvme")
      .describe("Parameter elements kept in CPU memory when parameters are offloaded to NVMe");
  b.add(&OffloadParamConfig::pin_memory, "pin_memory")
      .describe("Offload to page-locked (pinned) CPU memory, for asynchronous full-bandwidth transfers");
  Block block = b.build();
  block.auto_is_default = true;
  return block;
}

Block make_offload_optimizer() {
  BlockBuilder<OffloadOptimizerConfig> b("offload_optimizer");
  b.add(&OffloadOptimizerConfig::device, "device")
      .one_of({"none", "cpu", "nvme"}, true)
      .describe("Where optimizer states are offloaded (none, cpu or nvme); the optimizer step then runs on the CPU");
  b.add(&OffloadOptimizerConfig::nvme_path, "nvme_path")
      .describe("File-system path of the NVMe device optimizer states are offloaded to");
  b.add(&OffloadOptimizerConfig::buffer_count, "buffer_count")
      .min(0)
      .ignored("Strata's NVMe swapper always keeps two sets of three tile buffers (master and "
               "both moments), sized by sub_group_size")
      .describe("Buffers in the pool used to offload optimizer states to NVMe (at least the states per parameter)");
  b.add(&OffloadOptimizerConfig::pin_memory, "pin_memory")
      .describe("Offload to page-locked (pinned) CPU memory, for asynchronous full-bandwidth transfers");
  b.add(&OffloadOptimizerConfig::pipeline_read, "pipeline_read")
      .describe("In the tiled NVMe optimizer step, read the next tile while the current one is computed");
  b.add(&OffloadOptimizerConfig::pipeline_write, "pipeline_write")
      .describe("In the tiled NVMe optimizer step, write the previous tile while the current one is computed");
  b.add(&OffloadOptimizerConfig::fast_init, "fast_init")
      .ignored("Strata writes the initial NVMe state tile by tile in one pass either way")
      .describe("Initialize the optimizer faster when its states are offloaded to NVMe");
  b.add(&OffloadOptimizerConfig::ratio, "ratio")
      .range(0, 1)
      .describe("Fraction of the optimizer states updated by the CPU optimizer (partial offload, ZeRO-3 only)");
  b.add(&OffloadOptimizerConfig::super_offload, "super_offload")
      .describe("SuperOffload: each partition's CPU optimizer step starts during backward, speculatively, and is redone if invalid");
  b.add(&OffloadOptimizerConfig::convert_grad_on_cpu, "convert_grad_on_cpu")
      .ignored("Strata's CPU step reads the 16-bit gradients as they arrive and converts them on the CPU")
      .describe("Convert offloaded gradients to fp32 on the CPU rather than on the device before copying them");
  b.add(&OffloadOptimizerConfig::cpuadam_cores_perc, "cpuadam_cores_perc")
      .range(0, 1).ignored("DeepSpeed applies it with super_offload only; Strata's CPU Adam uses the "
                           "rank's CPU threads (OMP_NUM_THREADS, or the cores shared among local ranks)")
      .describe("Fraction of CPU cores the CPU Adam uses (ZeRO-3 with super_offload)");
  b.add(&OffloadOptimizerConfig::max_in_cpu, "max_in_cpu")
      .min(0)
      // The partitions' first tiles (sub_group_size) stay in host memory, the rest is swapped.
      .describe("Strata's own: optimizer-state elements (12 bytes each) a rank keeps in host memory with device nvme");
  Block block = b.build();
  block.auto_is_default = true;
  return block;
}

// zero_optimization.zenflow: DeepSpeed's keys (zenflow_config.py); what Strata does not run is
// refused by name in finish_zenflow (docs/zenflow.md says why).
void finish_zenflow(void* obj, Ctx& ctx, const std::string& path) {
  auto& z = *static_cast<ZenFlowConfig*>(obj);
  z.enabled = true;
  auto interval = [&](const json& v, const char* key) {
    const std::string at = join(path, key);
    if (v.is_string() && v.get<std::string>() == "auto") return;
    if (!v.is_number_integer() || v.get<int64_t>() < 1)
      ctx.error(at, fmt::format("{} must be a positive integer (or \"auto\"), got {}", at, v.dump()));
  };
  interval(z.select_interval, "select_interval");
  interval(z.update_interval, "update_interval");
  if (z.update_interval.is_string())
    ctx.error(join(path, "update_interval"),
              fmt::format("{}.update_interval \"auto\" is not run by Strata: DeepSpeed's adaptive "
                          "rule (0.19) divides every gradient by zero and clears its own update flag "
                          "before reading it (docs/zenflow.md). Give the optimizer steps between CPU "
                          "updates, e.g. 4", path));
  if (z.select_strategy != "step") {
    if (z.select_strategy == "auto" && !z.select_interval.is_string())
      ctx.error(join(path, "select_interval"),
                fmt::format("{}.select_interval is given with select_strategy \"auto\" (DeepSpeed "
                            "refuses it too): set select_strategy \"step\" or drop the interval",
                            path));
    else
      ctx.warn(join(path, "select_strategy"),
               fmt::format("{}.select_strategy \"{}\" reselects columns once per epoch of the "
                           "dataloader given to deepspeed.initialize, and without one (as under "
                           "Hugging Face's Trainer) never after the first selection; Strata's engine "
                           "is given none: columns are selected once, after the warm-up. Set "
                           "select_strategy \"step\" and select_interval N to reselect every N steps",
                           path, z.select_strategy));
  } else if (z.select_interval.is_string())
    ctx.error(join(path, "select_interval"),
              fmt::format("{}.select_interval must be a number of optimizer steps with "
                          "select_strategy \"step\" (as DeepSpeed requires)", path));
  if (z.select_interval.is_number_integer() && z.update_interval.is_number_integer() &&
      z.select_interval.get<int64_t>() > 0 &&
      z.select_interval.get<int64_t>() < z.update_interval.get<int64_t>())
    ctx.error(join(path, "select_interval"),
              fmt::format("{}.select_interval ({}) must be at least update_interval ({}): a "
                          "selection lasts at least one CPU update", path, z.select_interval.dump(),
                          z.update_interval.dump()));
}

Block make_zenflow() {
  BlockBuilder<ZenFlowConfig> b("zenflow");
  b.add(&ZenFlowConfig::topk_ratio, "topk_ratio")
      .range(0, 1)
      .describe("Share of each weight's gradient columns (the largest by L1 norm) updated on the GPU every step");
  b.add(&ZenFlowConfig::select_strategy, "select_strategy")
      .one_of({"auto", "step", "epoch"})
      .describe("When the columns are reselected: every select_interval steps (step) or epochs (epoch, auto)");
  b.add(&ZenFlowConfig::select_interval, "select_interval")
      .as(Kind::Any)
      .describe("Steps (or epochs) between column selections (Strata: steps, with select_strategy step)");
  b.add(&ZenFlowConfig::update_interval, "update_interval")
      .as(Kind::Any)
      .describe("Steps between CPU updates of the unselected columns, their gradients summed meanwhile");
  b.add(&ZenFlowConfig::overlap_step, "overlap_step")
      .describe("Run the CPU update beside the next window's steps (the unselected columns one window stale)");
  b.add(&ZenFlowConfig::offload, "offload")
      .not_implemented("Strata keeps the selected columns' moments on the device; set it false")
      .describe("Keep the selected columns' optimizer moments in host memory");
  b.add(&ZenFlowConfig::auto_ratio, "auto_ratio")
      .range(0, 1)
      .ignored("it tunes update_interval \"auto\", which Strata refuses")
      .describe("With update_interval auto: share of weights whose unselected gradients must outweigh the selected ones");
  b.add(&ZenFlowConfig::full_warm_up_rounds, "full_warm_up_rounds")
      .min(0)
      .describe("First steps run as plain offloaded steps before columns are first selected");
  b.add(&ZenFlowConfig::pt_reserved_cores_perc, "pt_reserved_cores_perc")
      .range(0, 1)
      .describe("With overlap_step: share of the intra-op threads kept for training, the rest for the CPU update");
  Block block = b.build();
  block.finish = finish_zenflow;
  return block;
}

const Block& zenflow_block() {
  static const Block b = make_zenflow();
  return b;
}

const Block& offload_param_block() {
  static const Block b = make_offload_param();
  return b;
}
const Block& offload_optimizer_block() {
  static const Block b = make_offload_optimizer();
  return b;
}

std::string parent(const std::string& path) {
  const size_t dot = path.rfind('.');
  return dot == std::string::npos ? "" : path.substr(0, dot);
}

std::optional<bool> legacy_bool(Ctx& ctx, const json& v, const std::string& path) {
  Field f;
  f.kind = Kind::Bool;
  auto c = convert(f, v, path, ctx);
  return c ? std::optional<bool>(c->get<bool>()) : std::nullopt;
}

// cpu_offload / cpu_offload_param: DeepSpeed turns `true` into {"device": "cpu"}.
void legacy_offload(Ctx& ctx, std::string& device, const json& v, const std::string& path,
                    const std::string& target) {
  auto on = legacy_bool(ctx, v, path);
  if (!on) return;
  const std::string canonical = join(parent(path), target);
  if (ctx.present.count(canonical) && *on) {
    ctx.error(path, fmt::format("{} (legacy) and {} both given; keep {} only", path, canonical, canonical));
    return;
  }
  ctx.warn(path, fmt::format("{} is deprecated; read as {}.device = \"{}\"", path, canonical, *on ? "cpu" : "none"));
  if (*on) device = "cpu";
}

// Cross-key rules inside zero_optimization, as DeepSpeed applies them.
void finish_zero(void* obj, Ctx& ctx, const std::string& path) {
  auto& z = *static_cast<ZeroConfig*>(obj);
  const std::string op = join(path, "offload_param"), oo = join(path, "offload_optimizer");
  if (z.offload_param.device != "none" && z.stage < 3) {
    ctx.warn(op, fmt::format("{}.device = \"{}\" has no effect at stage {} (parameter offload is a "
                             "stage-3 feature; DeepSpeed ignores it too): read as \"none\"",
                             op, z.offload_param.device, z.stage));
    z.offload_param.device = "none";
  }
  if (z.offload_optimizer.device != "none" && z.stage == 0) {
    ctx.warn(oo, fmt::format("{}.device = \"{}\" has no effect at stage 0 (ZeRO is off): read as "
                             "\"none\"", oo, z.offload_optimizer.device));
    z.offload_optimizer.device = "none";
  }
  // ratio: Strata keeps the rest of the optimizer on the device at stages 1-2 (its share at
  // stage 3 would be the units' shards, which the gathers read: not built).
  if (z.offload_optimizer.ratio < 1.0 && (z.offload_optimizer.device != "cpu" || z.stage == 3)) {
    ctx.warn(oo + ".ratio",
             fmt::format("{}.ratio = {} has no effect {}: read as 1 (the whole optimizer offloaded)",
                         oo, z.offload_optimizer.ratio,
                         z.offload_optimizer.device != "cpu"
                             ? fmt::format("with {}.device \"{}\"", oo, z.offload_optimizer.device)
                             : std::string("at stage 3 (Strata keeps a share of the optimizer on the "
                                           "device at stages 1-2)")));
    z.offload_optimizer.ratio = 1.0;
  }
  if (z.offload_optimizer.super_offload && z.offload_optimizer.device == "none") {
    ctx.warn(oo + ".super_offload", fmt::format("{}.super_offload has no effect without optimizer "
                                                "offload ({}.device \"none\"): read as false", oo, oo));
    z.offload_optimizer.super_offload = false;
  }
  if (z.offload_optimizer.super_offload && z.offload_optimizer.device == "nvme")
    ctx.error(oo + ".super_offload",
              fmt::format("{}.super_offload speculates the CPU step on state in host memory; with "
                          "device \"nvme\" the state streams through swap files. Use device \"cpu\", "
                          "or set super_offload false", oo));
  if (z.offload_optimizer.max_in_cpu > 0 && z.offload_optimizer.device != "nvme")
    ctx.error(oo + ".max_in_cpu",
              fmt::format("{}.max_in_cpu keeps part of the optimizer's NVMe state in host memory; with "
                          "device \"{}\" {}. Set device \"nvme\" or drop max_in_cpu", oo,
                          z.offload_optimizer.device,
                          z.offload_optimizer.device == "cpu" ? "all of it is in host memory already"
                                                              : "there is no offloaded state"));
  if (z.offload_optimizer.device == "nvme" && z.stage < 3)
    ctx.error(oo + ".device", fmt::format("{}.device = \"nvme\" needs stage 3 (stage is {}); use "
                                          "\"cpu\" or set stage 3", oo, z.stage));
  if (z.zenflow.enabled) {
    const std::string zf = join(path, "zenflow");
    if (z.stage != 1 && z.stage != 2)
      ctx.error(zf, fmt::format("{} needs stage 1 or 2 (stage is {}): {}", zf, z.stage,
                                z.stage == 0 ? "its unselected columns are stepped by the offloaded "
                                               "optimizer, which ZeRO partitions"
                                             : "Strata's ZenFlow at stage 3 (the columns of each "
                                               "rank's shards) is not built yet"));
    else if (z.offload_optimizer.device != "cpu")
      ctx.error(zf, fmt::format("{} steps the unselected columns on the CPU: it needs {}.device "
                                "\"cpu\" (is \"{}\")", zf, oo, z.offload_optimizer.device));
    else if (z.offload_optimizer.super_offload || z.offload_optimizer.ratio < 1.0)
      ctx.error(zf, fmt::format("{} decides itself what the device steps: drop {}.super_offload "
                                "and {}.ratio", zf, oo, oo));
  }
  if (z.offload_param.device == "nvme" && z.offload_param.nvme_path.empty())
    ctx.error(op + ".nvme_path", fmt::format("{}.nvme_path is required when device is \"nvme\"", op));
  if (z.offload_optimizer.device == "nvme" && z.offload_optimizer.nvme_path.empty())
    ctx.error(oo + ".nvme_path", fmt::format("{}.nvme_path is required when device is \"nvme\"", oo));
}

Block make_zero() {
  BlockBuilder<ZeroConfig> b("zero_optimization");
  b.add(&ZeroConfig::stage, "stage")
      .range(0, 3)
      .describe("ZeRO stage: 0 off, 1 partitions optimizer states, 2 also gradients, 3 also parameters");
  b.add(&ZeroConfig::contiguous_gradients, "contiguous_gradients")
      .describe("Copy gradients into a contiguous buffer as they are produced, avoiding fragmentation in backward");
  // Both choose how gradients travel, not what they are: Strata always takes the faster way.
  b.add(&ZeroConfig::reduce_scatter, "reduce_scatter")
      .when([](const json& v) { return v.is_boolean() && !v.get<bool>(); })
      .ignored("ZeRO-2 always reduce-scatters its gradient buckets (the same averages as the "
               "all-reduce DeepSpeed uses when this is false)")
      .describe("Average gradients with reduce or reduce-scatter instead of all-reduce");
  b.add(&ZeroConfig::reduce_bucket_size, "reduce_bucket_size")
      .min(0)
      // 0: one gradient at a time. Stage 3 cannot split a unit (its reduce-scatter leaves each
      // rank its shard), so there the key bounds the buckets held at once instead.
      .describe("Elements reduced at a time; bounds gradient reduction's memory (stage 3: one bucket per unit, "
                "2 x max(this, largest unit) held at most)");
  b.add(&ZeroConfig::allgather_partitions, "allgather_partitions")
      .describe("Gather the updated parameters with all-gather (true) or a series of broadcasts (false) after each "
                "step");
  b.add(&ZeroConfig::allgather_bucket_size, "allgather_bucket_size")
      .positive()
      .describe("Elements all-gathered at a time; bounds the memory of the parameter all-gather");
  b.add(&ZeroConfig::overlap_comm, "overlap_comm")
      .when([](const json& v) { return v.is_boolean() && !v.get<bool>(); })
      .ignored("every gradient bucket's reduction is launched during backward, overlapping it "
               "(the results are the same)")
      .describe("Overlap the reduction of gradients with the backward computation");
  b.add(&ZeroConfig::load_from_fp32_weights, "load_from_fp32_weights")
      .describe("Initialize fp32 master weights from the checkpoint's fp32 copies rather than the 16-bit model "
                "weights");
  b.add(&ZeroConfig::elastic_checkpoint, "elastic_checkpoint")
      .ignored("legacy in DeepSpeed, which points to universal checkpointing instead")
      .describe("Legacy elastic checkpoints (ZeRO-1/2 states loadable at another world size); superseded by "
                "universal checkpointing");
  b.block(&ZeroConfig::offload_param, "offload_param", offload_param_block())
      .describe("Offload parameters to CPU or NVMe (ZeRO-3 only)");
  b.block(&ZeroConfig::offload_optimizer, "offload_optimizer", offload_optimizer_block())
      .describe("Offload optimizer states to CPU or NVMe and run the optimizer step on the CPU");
  b.add(&ZeroConfig::sub_group_size, "sub_group_size")
      .min(0)
      .describe("Elements per tile of the optimizer step (ZeRO-3 with offload, ZeRO-Infinity), for very large "
                "models");
  b.add(&ZeroConfig::stage3_prefetch_bucket_size, "stage3_prefetch_bucket_size")
      .alias("prefetch_bucket_size").min(0)
      .describe("ZeRO-3: parameter elements fetched ahead of their use");
  b.add(&ZeroConfig::stage3_param_persistence_threshold, "stage3_param_persistence_threshold")
      .alias("param_persistence_threshold").min(0)
      .describe("ZeRO-3: parameters smaller than this (elements) are not partitioned but kept whole on every rank");
  b.add(&ZeroConfig::stage3_model_persistence_threshold, "stage3_model_persistence_threshold")
      .alias("model_persistence_threshold").min(0)
      .describe("ZeRO-3: upper bound on the total elements of unpartitioned (persistent) parameters");
  b.add(&ZeroConfig::stage3_max_live_parameters, "stage3_max_live_parameters")
      .alias("max_live_parameters").min(0)
      .describe("ZeRO-3: most parameter elements gathered on a rank at once before some are released");
  b.add(&ZeroConfig::stage3_max_reuse_distance, "stage3_max_reuse_distance")
      .alias("max_reuse_distance").min(0)
      .describe("ZeRO-3: keep a gathered parameter if it is used again within this many parameter elements");
  b.add(&ZeroConfig::stage3_gather_16bit_weights_on_model_save, "stage3_gather_16bit_weights_on_model_save")
      .alias("gather_16bit_weights_on_model_save")
      .deprecated_alias("stage3_gather_fp16_weights_on_model_save")
      .describe("ZeRO-3: gather the partitioned weights so save_16bit_model() writes the full 16-bit model");
  b.add(&ZeroConfig::ignore_unused_parameters, "ignore_unused_parameters")
      .when([](const json& v) { return v.is_boolean() && !v.get<bool>(); })
      .not_implemented("Strata gives a parameter without a gradient a zero gradient at every stage "
                       "(DeepSpeed's default, true); failing on one instead is not implemented")
      .describe("Tolerate parameters that get no gradient (dynamic networks) instead of failing; used at stage 2");
  b.add(&ZeroConfig::round_robin_gradients, "round_robin_gradients")
      .describe("Stages 1-2 with CPU offload: spread the copying of gradients to CPU memory across ranks");
  b.add(&ZeroConfig::zero_hpz_partition_size, "zero_hpz_partition_size")
      .min(0)
      .when([](const json& v) { return v.get<int64_t>() > 1; })
      .ignored("ZeRO++ hierarchical partitioning is a communication layout; the math is the same")
      .describe("ZeRO++ hpZ: ranks in the secondary parameter partition group (ideally a node's GPUs); 1: off");
  const char* quantized = "ZeRO++ quantized communication changes the numerics";
  b.add(&ZeroConfig::zero_quantized_weights, "zero_quantized_weights")
      .not_implemented(quantized)
      .describe("ZeRO++ qwZ: quantize weights for the all-gather");
  b.add(&ZeroConfig::zero_quantized_nontrainable_weights, "zero_quantized_nontrainable_weights")
      .not_implemented(quantized)
      .describe("Keep non-trainable weights quantized in memory and communication (LoRA training)");
  b.add(&ZeroConfig::zero_quantized_gradients, "zero_quantized_gradients")
      .not_implemented(quantized)
      .describe("ZeRO++ qgZ: quantize gradients for an all-to-all based reduction");
  b.add(&ZeroConfig::zeropp_loco_param, "zeropp_loco_param")
      .as(Kind::Object)
      .not_implemented("LoCo error feedback for quantized gradients")
      .describe("LoCo-ZeRO++: error feedback for quantized gradients (err_beta, reset_T)");
  b.add(&ZeroConfig::mics_shard_size, "mics_shard_size")
      .when([](const json& v) { return v.get<int64_t>() > 0; })
      .ignored("MiCS sharding groups are a communication layout; the math is the same")
      .describe("MiCS: ranks each model-state shard group spans; -1: off");
  b.add(&ZeroConfig::mics_hierarchical_params_gather, "mics_hierarchical_params_gather")
      .ignored(kZeroTuning)
      .describe("MiCS: gather parameters hierarchically, within nodes then across them");
  b.add(&ZeroConfig::memory_efficient_linear, "memory_efficient_linear")
      .ignored(kZeroTuning)
      .describe("ZeRO-3: use a linear layer that does not keep a gathered weight for backward");
  b.add(&ZeroConfig::log_trace_cache_warnings, "log_trace_cache_warnings")
      .ignored(kZeroTuning)
      .describe("ZeRO-3: log warnings of the parameter-fetch trace cache, such as invalidations");
  b.add(&ZeroConfig::use_multi_rank_bucket_allreduce, "use_multi_rank_bucket_allreduce")
      .ignored(kZeroTuning)
      .describe("Combine the reduce buckets of all ranks into one all-reduce instead of many reduces");
  b.add(&ZeroConfig::compute_grad_norm, "compute_grad_norm")
      .ignored(kZeroTuning)
      .describe("Compute the global gradient norm at each step (needed for clipping and reported)");
  b.add(&ZeroConfig::parameter_alignment, "parameter_alignment")
      .ignored(kZeroTuning)
      .describe("Align each parameter's start within the flat partition buffers");
  b.add(&ZeroConfig::stage3_module_granularity_threshold, "stage3_module_granularity_threshold")
      .alias("module_granularity_threshold").ignored(kZeroTuning)
      .describe("ZeRO-3: modules with fewer parameters per descendant than this are fetched as one unit");
  b.add(&ZeroConfig::stage3_use_all_reduce_for_fetch_params, "stage3_use_all_reduce_for_fetch_params")
      .alias("use_all_reduce_for_fetch_params").ignored(kZeroTuning)
      .describe("ZeRO-3: fetch a module's parameters with an all-reduce instead of an all-gather");
  b.add(&ZeroConfig::stage3_allgather_sequential, "stage3_allgather_sequential")
      .alias("allgather_sequential").ignored(kZeroTuning)
      .describe("ZeRO-3: all-gather parameters one by one instead of through flattened buckets");
  b.add(&ZeroConfig::stage3_partition_stream_chunk_size, "stage3_partition_stream_chunk_size")
      .alias("partition_stream_chunk_size").min(0).ignored(kZeroTuning)
      .describe("ZeRO-3: partition larger parameters at zero.Init by streaming chunks of this many elements; 0: "
                "off");
  b.add(&ZeroConfig::legacy_stage1, "legacy_stage1")
      .ignored(kZeroTuning)
      .describe("Use the old ZeRO stage 1 implementation");
  b.add(&ZeroConfig::pipeline_loading_checkpoint, "pipeline_loading_checkpoint")
      .ignored(kZeroTuning)
      .describe("ZeRO-3: load checkpoints in pipeline mode");
  b.add(&ZeroConfig::override_module_apply, "override_module_apply")
      .ignored(kZeroTuning)
      .describe("ZeRO-3: override nn.Module.apply so it sees gathered parameters");
  b.add(&ZeroConfig::enable_sanity_checks, "enable_sanity_checks")
      .ignored(kZeroTuning)
      .describe("Run internal sanity checks (for debugging)");
  b.add(&ZeroConfig::save_muon_momentum_buffer_in_memory, "save_muon_momentum_buffer_in_memory")
      .ignored("Strata has no Muon optimizer")
      .describe("ZeRO-3 with NVMe offload: keep the Muon momentum buffer in memory instead of swapping it");
  b.add(&ZeroConfig::leaf_module, "leaf_module")
      .as(Kind::Object).ignored(kZeroTuning)
      .describe("ZeRO-3: modules treated as leaves, whose parameters are fetched together");
  b.block(&ZeroConfig::zenflow, "zenflow", zenflow_block())
      .describe("ZenFlow: update the less important gradients asynchronously on the CPU while training continues")
      .printed = [](const void* o) { return static_cast<const ZeroConfig*>(o)->zenflow.enabled; };

  // Deprecated DeepSpeed keys, rewritten into the canonical ones.
  b.legacy("cpu_offload", [](Ctx& ctx, ZeroConfig& z, const json& v, const std::string& path) {
    legacy_offload(ctx, z.offload_optimizer.device, v, path, "offload_optimizer");
  })
      .describe("Deprecated: true offloads the optimizer to the CPU; use offload_optimizer");
  b.legacy("cpu_offload_param", [](Ctx& ctx, ZeroConfig& z, const json& v, const std::string& path) {
    legacy_offload(ctx, z.offload_param.device, v, path, "offload_param");
  })
      .deprecated_alias("cpu_offload_params")
      .describe("Deprecated: true offloads parameters to the CPU; use offload_param");
  b.legacy("cpu_offload_use_pin_memory", [](Ctx& ctx, ZeroConfig& z, const json& v, const std::string& path) {
    auto on = legacy_bool(ctx, v, path);
    if (!on) return;
    ctx.warn(path, fmt::format("{} is deprecated; read as pin_memory = {} in offload_param and "
                               "offload_optimizer", path, *on));
    z.offload_param.pin_memory = z.offload_optimizer.pin_memory = *on;
  })
      .describe("Deprecated: pinned CPU memory for offload; use pin_memory in offload_param / offload_optimizer");

  Block block = b.build();
  // DeepSpeed's oldest form: "zero_optimization": true means stage 1.
  block.coerce = [](const json& v, Ctx& ctx, const std::string& path) -> std::optional<json> {
    if (!v.is_boolean()) {
      ctx.error(path, fmt::format("{}: expected an object {{\"stage\": 0-3, ...}}, found {}", path, show(v)));
      return std::nullopt;
    }
    const int stage = v.get<bool>() ? 1 : 0;
    ctx.warn(path, fmt::format("{}: {} is DeepSpeed's deprecated form; read as {{\"stage\": {}}}", path,
                               show(v), stage));
    return json{{"stage", stage}};
  };
  block.finish = finish_zero;
  block.auto_is_default = true;
  return block;
}

}  // namespace

const Block& zero_block() {
  static const Block b = make_zero();
  return b;
}

}  // namespace strata::schema
