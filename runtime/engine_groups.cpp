// The engine's parameter groups (runtime/param_group.h): which holder each group gets, and how
// it is built. The dense parameters form one group over the data-parallel group; the MoE
// experts, when the model has any, a second one over their expert-data-parallel group, built by
// the same code with the experts' options (their gradient factor, norm group and swap name).
#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "moe/layer.h"
#include "runtime/engine.h"
#include "runtime/error.h"
#include "runtime/log.h"
#include "runtime/optim/adam.h"
#include "runtime/optim/fused_adam.h"

namespace strata {
namespace {

// A config's dtype name ("fp32", "fp16", "bf16", as the schema allows them).
torch::ScalarType dtype_named(const std::string& name) {
  if (name == "fp16") return torch::kHalf;
  if (name == "bf16") return torch::kBFloat16;
  return torch::kFloat;
}

// The dtype gradients travel in: communication_data_type, else fp16 under fp16 and fp32
// otherwise (DeepSpeed's defaults).
torch::ScalarType comm_dtype(const Config& config) {
  const auto& name = config.communication_data_type;
  if (!name.empty()) return dtype_named(name);
  return config.fp16.enabled ? torch::kHalf : torch::kFloat;
}

// The dtype gradients are summed in over the accumulation window (data_types.grad_accum_dtype):
// fp32 unless the config names the model's own dtype (the config's rules refuse other 16-bit
// dtypes), as DeepSpeed's bf16 optimizer accumulates in fp32.
torch::ScalarType accum_dtype(const Config& config) {
  const auto& named = config.data_types.grad_accum_dtype;
  return named ? dtype_named(*named) : torch::kFloat;
}

// Strata's Adam steps the flat master in one fused pass (a CUDA kernel on GPUs), and an
// offloaded step of it can overlap the next forward.
void use_flat_adam(zero::PartitionedOptimizer& partitioned,
                   const std::shared_ptr<torch::optim::Optimizer>& inner) {
  auto adam = std::dynamic_pointer_cast<optim::Adam>(inner);
  if (!adam || !adam->can_step_flat()) return;
  partitioned.use_flat_step(
      [adam](const torch::Tensor& grad, double grad_scale, const torch::Tensor& copy_out,
             int64_t tile_numel, const zero::PartitionedOptimizer::TileDone& after_tile) {
        adam->step_flat(grad, grad_scale, copy_out, tile_numel, after_tile);
      });
  partitioned.use_device_step([](const torch::Tensor& p, const torch::Tensor& m,
                                 const torch::Tensor& v, const torch::Tensor& grad,
                                 const torch::Tensor& out, const optim::AdamScalars& s) {
    optim::fused_adam_step(p, m, v, grad, out, s);
  });
  partitioned.use_overlapped_step([adam](double grad_scale, bool advance) {
    auto parts = adam->begin_flat_step(grad_scale, advance);
    return zero::PartitionedOptimizer::AdamTiles{parts.scalars, parts.exp_avg, parts.exp_avg_sq};
  });
}

}  // namespace

// Mixed precision and ZeRO 1-3 run through the partitioned optimizer (fp32 master weights over
// a flat buffer or the stage-3 units); plain fp32 stage 0 optimizes the module's own tensors.
// torch_autocast in fp16 scales the loss (DeepSpeed's GradScaler), which the partitioned
// optimizer unscales, at stage 0 too.
bool Engine::uses_partitioned_optimizer(const Config& config) {
  const bool fp16_autocast = config.torch_autocast.enabled && !config.bf16.enabled &&
                             torch_autocast_dtype(config.torch_autocast) == torch::kHalf;
  return config.zero_optimization.stage >= 1 || config.fp16.enabled || config.bf16.enabled ||
         fp16_autocast;
}

// torch_autocast, as DeepSpeed: the gradients of lower_precision_safe_modules' parameters travel
// in the autocast dtype, the others in fp32. Strata's reducer sends one dtype, so the autocast
// dtype only when every trainable parameter is in such a module (else fp32: never coarser than
// DeepSpeed). communication_data_type, when set, decides for all.
torch::ScalarType Engine::gradient_comm_dtype() const {
  if (autocast_plan_.enabled && !model_cast_ && config_.communication_data_type.empty())
    return autocast_safe_params_only_ ? autocast_plan_.dtype : torch::kFloat;
  return comm_dtype(config_);
}

void Engine::build_groups(InitOptions& options) {
  make_groups(options);
  // Each group's part of a checkpoint: the dense parameters' flat or per-parameter state, the
  // experts' per expert (runtime/engine_experts.cpp).
  dense().set_state_files(
      {[this](checkpoint::CheckpointWriter& w) { save_dense_states(w); },
       [this](const checkpoint::CheckpointReader& r, int64_t m) { return read_dense_states(r, m); }});
  if (auto* experts = expert_group())
    experts->set_state_files(
        {[this](checkpoint::CheckpointWriter& w) { save_expert_states(w); },
         [this](const checkpoint::CheckpointReader& r, int64_t m) { return read_expert_states(r, m); }});
}

void Engine::make_groups(InitOptions& options) {
  const auto& zero = config_.zero_optimization;
  // MoE: experts and the rest are partitioned over different groups, so both go through the
  // partitioned optimizer, whatever the precision and stage.
  if (!uses_partitioned_optimizer(config_) && experts_.empty()) {
    zero::GradientReducer::Options ro;
    ro.bucket_numel = zero.reduce_bucket_size.value;
    ro.comm_dtype = gradient_comm_dtype();
    groups_.push_back(std::make_unique<PlainGroup>(
        "dense", params_, make_optimizer_over(params_, options), group_, ro));
    return;
  }
  if (!experts_.empty() && std::all_of(params_.begin(), params_.end(),
                                       [&](const torch::Tensor& p) { return is_expert(p); }))
    throw Error("strata::initialize: every trainable parameter is an MoE expert; the engine "
                "needs the others (at least the gate) trainable too");
  zero::PartitionedOptions po;
  po.stage = zero.stage;
  po.comm_dtype = gradient_comm_dtype();
  po.reduce_bucket_numel = zero.reduce_bucket_size.value;
  po.accumulation_steps = gradient_accumulation_steps();
  po.accum_dtype = accum_dtype(config_);
  po.offload = optimizer_offload_options();
  if (const auto& zf = zero.zenflow; zf.enabled) {
    // The schema allows it at stages 1-2 with the optimizer in host memory (schema_zero.cpp).
    if (!experts_.empty())
      throw Error(fmt::format("{}: zero_optimization.zenflow with MoE experts is not built yet "
                              "(issue 61): drop the block or the experts", config_.source));
    po.zenflow.enabled = true;
    po.zenflow.topk_ratio = zf.topk_ratio;
    // "auto"/"epoch": selected once (DeepSpeed without a dataloader; the schema warned).
    po.zenflow.select_interval = zf.select_strategy == "step" ? zf.select_interval.get<int64_t>() : 0;
    po.zenflow.update_interval = zf.update_interval.get<int64_t>();
    po.zenflow.warm_up = zf.full_warm_up_rounds;
    po.zenflow.overlap = zf.overlap_step;
    po.zenflow.reserved_cores = zf.pt_reserved_cores_perc;
    log::info("[strata] ZenFlow: the top {} of each weight's gradient columns and every 1-D "
              "parameter stepped on the {} every step, the rest by the CPU every {} step(s){}; "
              "columns {} after {} plain step(s)",
              zf.topk_ratio, device_.str(), po.zenflow.update_interval,
              zf.overlap_step ? fmt::format(" beside the next window ({:.0f}% of the threads kept "
                                            "for training)", 100 * zf.pt_reserved_cores_perc)
                              : std::string(),
              po.zenflow.select_interval > 0
                  ? fmt::format("reselected every {} steps", po.zenflow.select_interval)
                  : std::string("selected once"),
              po.zenflow.warm_up);
  }
  if (zero.stage == 3) {
    build_unit_groups(po, options);
  } else {
    std::vector<torch::Tensor> dense, expert;
    for (const auto& p : params_) (is_expert(p) ? expert : dense).push_back(p);
    auto build = [&](std::vector<torch::Tensor> master) {
      return make_optimizer_over(master, options);
    };
    groups_.push_back(std::make_unique<PartitionedGroup>(
        "dense", std::make_unique<zero::PartitionedOptimizer>(dense, group_, po, build)));
    if (!experts_.empty())
      groups_.push_back(std::make_unique<PartitionedGroup>(
          "experts", make_expert_optimizer(po, options, nullptr, expert)));
  }
  for (const auto& g : groups_) use_flat_adam(*g->partitioned(), g->optimizer());
  if (po.zenflow.enabled) {
    const auto adam = std::dynamic_pointer_cast<optim::Adam>(dense().optimizer());
    if (!adam || !adam->can_step_flat())
      throw Error(fmt::format("{}: zero_optimization.zenflow steps Strata's Adam/AdamW (optimizer.type "
                              "\"Adam\" or \"AdamW\", one param group) on the device and on the CPU; "
                              "this optimizer keeps state it does not know",
                              config_.source));
  }
  finish_optimizer_offload();
  if (auto* experts = expert_group()) {
    const double lr = optimizer_group_lr(dense());
    expert_lr_ratio_ = lr > 0 ? optimizer_group_lr(*experts) / lr : 1.0;
  }
}

double Engine::optimizer_group_lr(const ParamGroup& group) {
  return group.optimizer()->param_groups().at(0).options().get_lr();
}

void Engine::build_unit_groups(const zero::PartitionedOptions& po, InitOptions& options) {
  // Every parameter, frozen ones too, is cut into units and sharded; from here on a unit's bytes
  // exist only while the model uses it (zero/param_coordinator.h).
  const auto& zero = config_.zero_optimization;
  const auto& init = options.partitioned_init;
  zero::UnitOptions uo;
  uo.persistence_threshold = zero.stage3_param_persistence_threshold.value;
  uo.model_persistence_threshold = zero.stage3_model_persistence_threshold;
  // NVMe offload: every unit's shard on the swap files' 4 KiB grid, in the parameters' file (the
  // model's dtype) and the gradient's (whose chunks are the units' shards, in the communication
  // dtype): aligned for the narrower of the two, which suits both.
  if (zero.offload_param.device == "nvme" || zero.offload_optimizer.device == "nvme")
    uo.alignment = int64_t(offload::kIoAlign) /
                   std::min<int64_t>(params_.front().element_size(),
                                     int64_t(c10::elementSize(po.comm_dtype)));
  // The units live on the model's device (InitOptions::device: a host-built model moves there a
  // unit at a time); such a model's shards, with parameters and optimizer both offloaded, are
  // built in host memory, where they will live, so that the device never holds them all.
  uo.device = device_;
  if (params_.front().device() != device_ && zero.offload_param.device != "none" &&
      po.offload.enabled)
    uo.partition_device = torch::kCPU;
  zero::CoordinatorOptions co;
  co.prefetch_numel = zero.stage3_prefetch_bucket_size.value;
  co.max_live_numel = zero.stage3_max_live_parameters;
  co.max_reuse_distance = zero.stage3_max_reuse_distance;

  zero::ParamUnits::ValueOf value_of;
  if (init)
    value_of = [&](const torch::Tensor& p) {
      return init->shard_of(p) ? init->take_full_value(p) : p;
    };
  auto specs = zero::plan_units(*module_, options.stage3_units);
  // The experts are units of their own, over their own group (below). A frozen parameter that
  // is not floating point (an index table) is never trained or cast: it stays whole on every
  // rank, as DeepSpeed keeps what it does not partition.
  for (auto& spec : specs) {
    zero::UnitSpec kept{spec.name, {}, {}};
    for (size_t i = 0; i < spec.params.size(); ++i)
      if (!is_expert(spec.params[i]) &&
          (spec.params[i].is_floating_point() || spec.params[i].requires_grad())) {
        kept.param_names.push_back(spec.param_names[i]);
        kept.params.push_back(spec.params[i]);
      }
    spec = std::move(kept);
  }
  specs.erase(std::remove_if(specs.begin(), specs.end(),
                             [](const zero::UnitSpec& s) { return s.params.empty(); }),
              specs.end());
  auto units = std::make_shared<zero::ParamUnits>(std::move(specs), group_, uo, value_of);
  if (init) init->release();  // the units own the parameters now
  auto build = [&](std::vector<torch::Tensor> master) {
    return make_optimizer_over(master, options);
  };
  auto coordinator = std::make_unique<zero::ParamCoordinator>(units, group_, co);
  auto partitioned = std::make_unique<zero::PartitionedOptimizer>(units, group_, po, build);
  groups_.push_back(std::make_unique<UnitGroup>("dense", units, std::move(coordinator),
                                                std::move(partitioned)));
  if (!experts_.empty()) {
    // One unit per MoE layer: this rank's experts of it, sharded over the ranks that hold the
    // same experts (the expert-data-parallel group; with ep_size = world size nobody else does,
    // and the unit is whole here, released and read back between uses like any other). Streamed
    // experts (moe.expert_unit_size): one unit per unit of the layer's experts, never persistent,
    // at most moe.expert_window of them gathered at once.
    std::vector<zero::UnitSpec> expert_specs;
    std::map<std::string, size_t> spec_of;
    bool streamed = false;
    for (const auto& e : experts_) {
      const std::string name = e.layer_prefix + "experts" + (e.unit.empty() ? "" : "." + e.unit);
      streamed = streamed || !e.unit.empty();
      auto [it, fresh] = spec_of.try_emplace(name, expert_specs.size());
      if (fresh) expert_specs.push_back({name, {}, {}});
      expert_specs[it->second].param_names.push_back(e.name);
      expert_specs[it->second].params.push_back(e.param);
    }
    const auto& edp = expert_groups_.expert_data_parallel;
    auto euo = uo;
    if (streamed) euo.persistence_threshold = 0;
    auto expert_units = std::make_shared<zero::ParamUnits>(std::move(expert_specs), edp, euo);
    auto eco = co;
    if (streamed) {
      int64_t largest = 0, largest_bytes = 0;  // elements, and bytes with the shards' padding
      for (size_t u = 0; u < expert_units->size(); ++u) {
        const auto& unit = expert_units->unit(u);
        largest = std::max(largest, unit.numel);
        largest_bytes = std::max(largest_bytes, unit.full.numel() * unit.full.element_size());
      }
      eco.max_live_numel = std::min(co.max_live_numel, config_.moe.expert_window * largest);
      // The window bounds them, not the reuse distance (DeepSpeed's default of 1e9 elements
      // would keep every unit from forward to backward).
      eco.max_reuse_distance = 0;
      expert_window_bytes_ = config_.moe.expert_window * largest_bytes;
      // The units run where any rank of the group that gathers them has tokens for them.
      for (auto* layer : moe_layers_) layer->experts->set_agreement_group(edp);
    }
    auto expert_coordinator = std::make_unique<zero::ParamCoordinator>(expert_units, edp, eco);
    auto expert_partitioned = make_expert_optimizer(po, options, expert_units, {});
    groups_.push_back(std::make_unique<UnitGroup>("experts", expert_units,
                                                  std::move(expert_coordinator),
                                                  std::move(expert_partitioned)));
  }
  offload_parameters();  // after the optimizers read the partitions
  move_rest_to_device();  // buffers and parameters outside every unit
}

std::unique_ptr<zero::PartitionedOptimizer> Engine::make_expert_optimizer(
    const zero::PartitionedOptions& po, InitOptions& options,
    const std::shared_ptr<zero::ParamUnits>& units, const std::vector<torch::Tensor>& experts) {
  // Averaged over their expert-data-parallel group, scaled to the world's mean, their norm
  // summed over the expert-parallel group (zero/partitioned_optimizer.h).
  const auto& edp = expert_groups_.expert_data_parallel;
  auto eo = po;
  eo.gradient_factor = static_cast<double>(edp ? edp->size() : 1) / data_parallel_size();
  eo.norm_group = expert_groups_.expert_parallel;
  // Expert units no token reaches are the same on every rank of the group (moe/experts.h agrees
  // on them), so every rank settles their buckets at the same point of its collectives.
  eo.settle_unreached = true;
  eo.offload.swap_name = "expert-optimizer";  // beside the others' files in one NVMe store
  auto build = [&](std::vector<torch::Tensor> master) {
    if (!options.expert_optimizer_builder) return make_optimizer_over(master, options);
    std::shared_ptr<torch::optim::Optimizer> built = options.expert_optimizer_builder(master);
    if (!built) throw Error("strata::initialize: expert_optimizer_builder returned null");
    return built;
  };
  if (units) return std::make_unique<zero::PartitionedOptimizer>(units, edp, eo, build);
  return std::make_unique<zero::PartitionedOptimizer>(experts, edp, eo, build);
}

}  // namespace strata
