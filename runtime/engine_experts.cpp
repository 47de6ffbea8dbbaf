// The engine's MoE side (DeepSpeed-MoE's engine and ZeRO handling of expert parameters):
//   - the expert parameters of the model's strata::moe::MoE layers differ across the ranks of an
//     expert-parallel group; they are checked and broadcast within their expert-data-parallel
//     group, and trained by a second partitioned optimizer over that group; at ZeRO stage 3 they
//     are also sharded over it: one unit per MoE layer (its local experts), gathered on use by a
//     second coordinator and offloaded with offload_param like the others (DeepSpeed refuses MoE
//     at stage 3; this is what lets experts larger than the devices' memory train);
//   - checkpoints hold them per expert: every rank's partition of the expert master weights,
//     optimizer state and 16-bit weights is saved with its place in a global layout that does
//     not depend on ep_size (layer, then global expert, then the expert's parameters), so a
//     checkpoint saved at one ep_size (or world size, or ZeRO stage) loads at another.
#include <algorithm>
#include <cmath>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "moe/layer.h"
#include "runtime/checkpoint/layout.h"
#include "runtime/checkpoint/saved_experts.h"
#include "runtime/checkpoint/shard_pieces.h"
#include "runtime/engine.h"
#include "runtime/error.h"
#include "runtime/log.h"
#include "runtime/master_state.h"
#include "runtime/model_check.h"
#include "runtime/optim/state_io.h"

namespace strata {
namespace {

// Where this rank's expert elements sit in the global expert layout.
struct ExpertLayout {
  struct Segment {
    int64_t local = 0, length = 0, global = 0;  // flat [local, +length) is global [global, ...)
  };
  std::vector<Segment> segments;  // sorted by `local`
  int64_t numel = 0;              // every expert of every layer
  json describe = json::array();  // per layer: its name, experts, each expert's parameters
};


// This rank's expert elements in one local flat layout, and its partition of that layout:
// stages 0-2 the experts' FlatParams; stage 3 the experts' units' trainable parameters laid out
// one after another (the partition's pieces of it from ParamUnits::shards_over).
struct LocalExperts {
  std::vector<torch::Tensor> params;
  std::vector<int64_t> offsets;
  int64_t numel = 0;
  zero::ShardMap shards;
  int64_t part = 0;
};

LocalExperts local_experts(const zero::PartitionedOptimizer& ep) {
  LocalExperts out;
  out.part = ep.partition_index();
  if (const auto* units = ep.units()) {
    for (const auto& p : units->trainable_params()) {
      out.params.push_back(p);
      out.offsets.push_back(out.numel);
      out.numel += p.numel();
    }
    out.shards = units->shards_over(out.offsets);
    return out;
  }
  const auto& flat = ep.flat();
  for (size_t i = 0; i < flat.params().size(); ++i) {
    out.params.push_back(flat.params()[i]);
    out.offsets.push_back(flat.offset(i));
  }
  out.numel = flat.padded_numel();
  out.shards = ep.shards();
  return out;
}

ExpertLayout expert_layout(const std::vector<moe::ExpertParameter>& experts,
                           const LocalExperts& local) {
  struct Layer {
    int64_t experts = 0, expert_numel = 0, base = 0;
    json described = json::array();         // per parameter: name, per-expert shape, stacked
    std::map<std::string, int64_t> offset;  // per-expert name -> offset within one expert
    std::map<std::string, int64_t> numel;   // per-expert name -> elements per expert
  };
  std::vector<std::string> order;
  std::map<std::string, Layer> layers;
  for (const auto& e : experts) {
    auto [it, fresh] = layers.try_emplace(e.layer_prefix);
    if (fresh) order.push_back(e.layer_prefix);
    auto& l = it->second;
    l.experts = e.layer_experts;
    const std::string& name = e.per_expert_name;  // "w1", a user expert's "fc.weight"
    const int64_t numel = e.param.numel() / e.num_experts;
    if (!l.offset.count(name)) {
      l.offset[name] = l.expert_numel;
      l.numel[name] = numel;
      l.expert_numel += numel;
      auto shape = e.param.sizes().vec();
      if (e.stacked) shape.erase(shape.begin());
      l.described.push_back({{"name", name}, {"shape", shape}, {"stacked", e.stacked}});
    } else if (l.numel.at(name) != numel) {
      throw Error(fmt::format("MoE checkpoint: expert parameter '{}' has {} elements per expert "
                              "but another expert's '{}' has a different size; the experts of one "
                              "layer must have the same shapes",
                              e.name, numel, name));
    }
  }
  ExpertLayout out;
  for (const auto& prefix : order) {
    auto& l = layers[prefix];
    l.base = out.numel;
    out.numel += l.experts * l.expert_numel;
    out.describe.push_back(
        {{"layer", prefix + "experts"}, {"experts", l.experts}, {"params", l.described}});
  }
  std::unordered_map<const c10::TensorImpl*, const moe::ExpertParameter*> by_impl;
  for (const auto& e : experts) by_impl[e.param.unsafeGetTensorImpl()] = &e;
  for (size_t i = 0; i < local.params.size(); ++i) {
    const auto& e = *by_impl.at(local.params[i].unsafeGetTensorImpl());
    const auto& l = layers[e.layer_prefix];
    const int64_t per = e.param.numel() / e.num_experts;
    for (int64_t j = 0; j < e.num_experts; ++j)
      out.segments.push_back({local.offsets[i] + j * per, per,
                              l.base + (e.first_expert + j) * l.expert_numel +
                                  l.offset.at(e.per_expert_name)});
  }
  std::sort(out.segments.begin(), out.segments.end(),
            [](const auto& a, const auto& b) { return a.local < b.local; });
  return out;
}

// A partition's pieces of the local flat layout as pieces of the global expert layout (padding
// between and after the parameters falls out).
std::vector<zero::ShardPiece> to_global(const std::vector<zero::ShardPiece>& pieces,
                                        const ExpertLayout& layout) {
  std::vector<zero::ShardPiece> out;
  for (const auto& p : pieces)
    for (const auto& s : layout.segments) {
      const int64_t lo = std::max(p.flat_begin, s.local);
      const int64_t hi = std::min(p.flat_begin + p.length, s.local + s.length);
      if (lo < hi) out.push_back({s.global + (lo - s.local), hi - lo, p.offset + (lo - p.flat_begin)});
    }
  return out;
}

}  // namespace

bool Engine::is_expert(const torch::Tensor& p) const {
  for (const auto& e : experts_)
    if (e.param.unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) return true;
  return false;
}

void Engine::find_experts() {
  experts_ = moe::expert_parameters(*module_);
  refuse_experts_outside_moe_layers();
  if (experts_.empty()) {
    if (!config_.moe.given.empty())
      log::info("[strata] note: the config has a moe block, but the model has no strata::moe::MoE "
                "layer; the block is read by programs that build their layers from it "
                "(moe::MoEOptions::from_config)");
    return;
  }
  moe_layers_ = moe::moe_layers(*module_);
  const auto& first = experts_.front();
  for (const auto& e : experts_) {
    if (e.ep_size != first.ep_size)
      throw Error(fmt::format("strata::initialize: MoE layers with different ep_size: '{}' has {}, "
                              "'{}' has {}; every layer of a model uses one expert-parallel size",
                              first.name, first.ep_size, e.name, e.ep_size));
    if (!e.param.requires_grad())
      throw Error(fmt::format("strata::initialize: expert parameter '{}' is frozen; frozen experts "
                              "are not supported (their checkpoints are kept per expert with the "
                              "optimizer's)",
                              e.name));
  }
  const int64_t ep = first.ep_size;
  // The layers are the program's, built before the engine saw the config: a key of the moe block
  // they do not follow would do nothing.
  for (auto* layer : moe_layers_) {
    const std::string differs = layer->options().differs_from(config_.moe);
    if (!differs.empty())
      throw Error(fmt::format("{}: {} (MoE layer {}); build the layers from the config "
                              "(moe::MoEOptions::from_config) or drop the key from its moe block",
                              config_.source, differs, layer->options().layer_id));
    if (layer->options().expert_unit_size > 0 && config_.zero_optimization.stage < 3)
      throw Error(fmt::format("{}: MoE layer {} streams its experts (expert_unit_size {}), which "
                              "ZeRO stage 3 does; at stage {} every rank keeps its experts whole. "
                              "Set zero_optimization.stage to 3 or build the layer with "
                              "expert_unit_size 0",
                              config_.source, layer->options().layer_id,
                              layer->options().expert_unit_size, config_.zero_optimization.stage));
  }
  // An ep_size that does not divide the world is refused here, by comm's expert layout.
  expert_groups_ = comm::expert_groups(group_, static_cast<int>(ep));
  // The experts are broadcast, reduced and checkpointed as the layout places them: a layer built
  // over a group of the right size but other members (or another order) would train and save
  // other ranks' experts under this rank's indices.
  const auto& layout_group = expert_groups_.expert_parallel;
  for (auto* layer : moe_layers_) {
    const auto& g = layer->options().ep_group;
    if ((g ? g->size() : 1) != ep)
      throw Error(fmt::format("strata::initialize: an MoE layer's expert-parallel group has {} "
                              "ranks for ep_size {}",
                              g ? g->size() : 1, ep));
    if (ep > 1 && g->world_ranks() != layout_group->world_ranks())
      throw Error(fmt::format(
          "strata::initialize: MoE layer {} (rank {}) was built over the expert-parallel group of "
          "world ranks [{}], but for ep_size {} the engine's layout puts this rank in the group of "
          "ranks [{}] (runs of ep_size consecutive ranks, as DeepSpeed's); build the layers' "
          "groups with comm::expert_groups(world, ep_size).expert_parallel (as "
          "moe::MoEOptions::from_config does)",
          layer->options().layer_id, data_parallel_rank(), fmt::join(g->world_ranks(), ", "), ep,
          fmt::join(layout_group->world_ranks(), ", ")));
  }
  const auto& edp = expert_groups_.expert_data_parallel;
  log::info("[strata] MoE: {} expert parameter tensor(s) in {} layer(s), ep_size {}: expert "
            "gradients reduced over expert-data-parallel groups of {} rank(s)",
            experts_.size(), moe_layers_.size(), ep, edp ? edp->size() : 1);
}

void Engine::refuse_experts_outside_moe_layers() const {
  // Experts of one's own router would be ordinary parameters here: broadcast from rank 0 and
  // averaged over every rank, silently mixing experts that differ per rank. Their usual name
  // (Mixtral's, DeepSeek's "...experts.N...") is how they are recognised.
  std::unordered_set<std::string> known;
  for (const auto& e : experts_) known.insert(e.name);
  for (const auto& p : module_->named_parameters(/*recurse=*/true)) {
    if (known.count(p.key()) || !moe::is_expert_parameter_name(p.key())) continue;
    throw Error(fmt::format(
        "strata::initialize: parameter '{}' sits in a module named 'experts' outside any "
        "strata::moe::MoE layer; the engine would treat it as an ordinary data-parallel "
        "parameter (rank 0's values on every rank, gradients averaged over all ranks), which "
        "mixes experts that differ per rank. Put the experts in a strata::moe::MoE layer "
        "(MoEOptions::expert_factory builds your own expert modules in it) or, if this is not "
        "an expert, name its module otherwise",
        p.key()));
  }
}

void Engine::key_gate_noise() {
  // Micro-batch m of rank r in step s is the global batch's chunk (s * gas + m) * world + r,
  // whatever the world size and accumulation (micro_steps_ restarts at global_steps * gas after
  // a resume): a resumed run at another world size draws the noise of the run it continues.
  const int64_t index = micro_steps_ * data_parallel_size() + data_parallel_rank();
  for (auto* layer : moe_layers_) layer->begin_micro_batch(index);
}

void Engine::check_and_broadcast_experts() {
  const auto& edp = expert_groups_.expert_data_parallel;
  if (experts_.empty() || !edp || edp->size() == 1) return;
  const auto names = expert_names();
  check_same_model_on_every_rank(
      *module_, *edp, [&](const std::string& name) { return names.count(name) > 0; },
      /*buffers=*/false);
  torch::NoGradGuard no_grad;
  for (const auto& e : experts_) edp->broadcast(e.param.detach(), 0);
}

void Engine::follow_lr_schedule() {
  const auto* experts = expert_group();
  if (!experts) return;
  const double lr = optimizer_group_lr(dense()) * expert_lr_ratio_;
  for (auto& group : experts->optimizer()->param_groups()) group.options().set_lr(lr);
}

void Engine::balance_experts() {
  std::vector<moe::MoEImpl*> layers;
  for (auto* layer : moe_layers_)
    if (layer->options().bias_update_speed > 0) layers.push_back(layer);
  if (layers.empty()) return;
  const auto device = experts_.front().param.device();
  std::vector<torch::Tensor> loads;
  for (auto* layer : layers) loads.push_back(layer->take_expert_load().to(device));
  if (last_step_skipped_) return;  // an overflow step moves nothing, the bias neither
  auto total = torch::stack(loads);  // [layers, E] int64: exact sums
  if (group_) group_->all_reduce(total, comm::ReduceOp::Sum);
  total = total.cpu();
  for (size_t i = 0; i < layers.size(); ++i) layers[i]->update_expert_bias(total[int64_t(i)]);
  if (!group_ || group_->size() < 2) return;
  // Every rank moved the same bias by the same loads; a rank whose bias differs (a program that
  // set it on one rank only) would route otherwise from now on: stop, naming the layer.
  std::vector<torch::Tensor> biases;
  for (auto* layer : layers) biases.push_back(layer->expert_bias().cpu());
  const auto mine = torch::cat(biases);
  const auto both = torch::cat({mine, -mine});
  auto highest = both.to(device);
  group_->all_reduce(highest, comm::ReduceOp::Max);
  const auto differs = highest.cpu().ne(both).nonzero();
  if (differs.numel() > 0) {
    const int64_t at = differs[0][0].item<int64_t>() % mine.numel();
    const int64_t E = layers.front()->options().num_experts;
    throw Error(fmt::format("step {}: MoE layer {}'s expert bias differs between ranks (expert {} "
                            "here {}); set it on every rank alike (set_expert_bias) or not at all",
                            global_steps_ + 1, layers[size_t(at / E)]->options().layer_id,
                            at % E, mine[at].item<float>()));
  }
}

void Engine::save_expert_states(checkpoint::CheckpointWriter& writer) {
  const auto* experts = expert_group();
  if (!experts) return;
  const auto& ep = *experts->partitioned();
  const auto local = local_experts(ep);
  const auto layout = expert_layout(experts_, local);
  const auto& shards = local.shards;
  const int64_t part = local.part;
  // Unpartitioned (stage 0), every rank of an expert-data-parallel group holds the same experts:
  // its first rank writes them.
  const auto& edp = expert_groups_.expert_data_parallel;
  const bool writes = shards.parts() > 1 || !edp || edp->rank() == 0;
  json scalars = {{"expert_layout", layout.describe}, {"expert_numel", layout.numel}};
  // Each layer's call counter, which names its gate noise (moe/layer.h): a resumed run draws on.
  json calls = json::array();
  for (const auto* layer : moe_layers_) calls.push_back(layer->call_index());
  scalars["moe_call_index"] = calls;
  // The sigmoid routers' biases are buffers of the model (model_states); checkpoints before
  // that kept them here, as moe_expert_bias, which read_expert_states still reads.
  if (!writes) {
    scalars["expert_pieces"] = json::array();
    writer.write_partition("expert_states", {}, scalars);
    return;
  }
  scalars["expert_pieces"] = checkpoint::pieces_json(to_global(shards.pieces(part), layout));
  // Streamed (NVMe: a tile at a time); the state's scalars join `scalars` before the footer.
  writer.stream_partition("expert_states", [&](checkpoint::TensorFileWriter& out) {
    if (!write_master_state(ep, *experts->optimizer(), out, scalars))
      throw Error("save_checkpoint: the experts' optimizer state cannot be saved per expert (only "
                  "Strata's Adam and SGD state can); use one of them for MoE models");
    // The 16-bit weights of the partition: stage 3 keeps them as the units' shards (on NVMe
    // they have no bytes here, and equal the master cast, which is how every step writes them).
    const auto* units = ep.units();
    if (!units) {
      out.add("weights", shards.gather(ep.flat().data(), part));
    } else if (units->partition_offload() != "nvme") {
      out.add("weights", units->partition());
    } else if (!ep.swaps()) {  // parameters on NVMe, the master in host memory
      out.add("weights", ep.master().to(units->partition().scalar_type()));
    } else {
      const auto dtype = units->partition().scalar_type();
      out.begin({"weights", dtype, {units->partition().numel()}});
      ep.read_swapped_tiles(offload::OptimizerSwapper::kMaster,
                            [&](int64_t, int64_t n, const float* src) {
                              const auto cast =
                                  torch::from_blob(const_cast<float*>(src), {n}, torch::kFloat)
                                      .to(dtype);
                              out.write(cast.data_ptr(), size_t(cast.nbytes()));
                            });
      out.end();
    }
  }, scalars);
}

GroupInstall Engine::read_expert_states(const checkpoint::CheckpointReader& reader,
                                       int64_t saved_micro_steps) {
  const bool has_experts = reader.has_partition("expert_states");
  const auto* experts = expert_group();
  if (!has_experts)
    throw Error(fmt::format("{}: the checkpoint holds no MoE experts and this model has MoE layers",
                            reader.folder()));
  const auto& ep = *experts->partitioned();
  const auto local = local_experts(ep);
  const auto layout = expert_layout(experts_, local);
  // Every rank's file: the partitions that cover the global layout, each expert once. This
  // rank's partition and its 16-bit weights are read from them by range when installed.
  const auto saved = std::make_shared<const checkpoint::SavedExperts>(reader);
  if (saved->layout() != layout.describe)
    throw Error(fmt::format("{}: the checkpoint's MoE experts are not this model's: saved {}, this "
                            "model {}",
                            reader.folder(), saved->layout().dump(), layout.describe.dump()));
  const auto pieces = to_global(local.shards.pieces(local.part), layout);
  const auto state = saved_state_header(saved->scalars(), saved->state_tensors(), ep.master());
  optim::check_param_state(*experts->optimizer(), ep.master(), state);
  // The layers' call counters (the same on every rank of a program whose ranks run the same
  // forwards). A checkpoint from before they were saved: one forward per micro-step, the usual
  // loop, so that the noise at least does not replay calls 0, 1, ...
  const auto layers = moe_layers_;
  std::vector<int64_t> calls(layers.size(), saved_micro_steps);
  if (saved->scalars().contains("moe_call_index")) {
    const json& saved_calls = saved->scalars().at("moe_call_index");
    if (!saved_calls.is_array() || saved_calls.size() != layers.size())
      throw Error(fmt::format("{}: moe_call_index is {}; this model has {} MoE layer(s), one "
                              "call counter each",
                              reader.folder(), saved_calls.dump().substr(0, 80), layers.size()));
    for (size_t i = 0; i < layers.size(); ++i) {
      if (!saved_calls[i].is_number_integer() || saved_calls[i].get<int64_t>() < 0)
        throw Error(fmt::format("{}: moe_call_index[{}] is {}, not a call count",
                                reader.folder(), i, saved_calls[i].dump().substr(0, 80)));
      calls[i] = saved_calls[i].get<int64_t>();
    }
  }
  // The sigmoid routers' biases as checkpoints kept them before they were buffers (a checkpoint
  // from before either: zeros, as a new run's; a newer one restores them with the buffers).
  std::vector<torch::Tensor> biases(layers.size());
  if (saved->scalars().contains("moe_expert_bias")) {
    const json& saved_biases = saved->scalars().at("moe_expert_bias");
    if (!saved_biases.is_array() || saved_biases.size() != layers.size())
      throw Error(fmt::format("{}: moe_expert_bias is {}; this model has {} MoE layer(s)",
                              reader.folder(), saved_biases.dump().substr(0, 80), layers.size()));
    for (size_t i = 0; i < layers.size(); ++i) {
      const json& b = saved_biases[i];
      const bool has = layers[i]->expert_bias().defined();
      if (b.is_null() != !has)
        throw Error(fmt::format("{}: MoE layer {} {} an expert bias in the checkpoint and {} here "
                                "(score_func differs between the runs)", reader.folder(), i,
                                b.is_null() ? "has no" : "has", has ? "one" : "none"));
      if (b.is_null()) continue;
      std::vector<double> values;
      try {
        values = b.get<std::vector<double>>();
      } catch (const json::exception&) {
        throw Error(fmt::format("{}: moe_expert_bias[{}] is not a list of numbers", reader.folder(), i));
      }
      if (int64_t(values.size()) != layers[i]->options().num_experts)
        throw Error(fmt::format("{}: moe_expert_bias[{}] holds {} values for {} experts",
                                reader.folder(), i, values.size(), layers[i]->options().num_experts));
      biases[i] = torch::tensor(values, torch::kDouble).to(torch::kFloat);
    }
  }
  // Without counters (saved by an older Strata) they count the saved run's micro-steps. Either
  // way they matter only to a layer called outside engine->forward, which keys the noise by the
  // global micro-batch (key_gate_noise).
  GroupInstall out;
  out.install = [this, saved, pieces, state, layout, local, layers, calls, biases] {
    for (size_t i = 0; i < layers.size(); ++i) layers[i]->set_call_index(calls[i]);
    for (size_t i = 0; i < layers.size(); ++i)
      if (biases[i].defined()) layers[i]->set_expert_bias(biases[i]);
    auto& ep = *expert_group()->partitioned();
    install_master_state(
        ep, *expert_group()->optimizer(),
        [&](const std::string& name, int64_t offset, int64_t n, float* dst) {
          saved->read(name, pieces, offset, n, dst);
        },
        state);
    // Local flat elements [lo, lo + n) of the saved 16-bit weights (zeros between experts).
    auto weights = [&](int64_t lo, int64_t n) {
      std::vector<zero::ShardPiece> from;
      for (const auto& s : layout.segments) {
        const int64_t a = std::max(lo, s.local), b = std::min(lo + n, s.local + s.length);
        if (a < b) from.push_back({s.global + (a - s.local), b - a, a - lo});
      }
      auto t = torch::empty({n}, torch::TensorOptions().dtype(saved->dtype("weights")));
      saved->read("weights", from, 0, n, t.data_ptr());
      return t;
    };
    if (auto* units = ep.units()) {  // stage 3: each unit's shard from its parameters' values
      std::unordered_map<const c10::TensorImpl*, int64_t> offset;
      for (size_t i = 0; i < local.params.size(); ++i)
        offset[local.params[i].unsafeGetTensorImpl()] = local.offsets[i];
      for (size_t u = 0; u < units->size(); ++u) {
        std::vector<torch::Tensor> values;
        for (const auto& p : units->unit(u).params)
          values.push_back(weights(offset.at(p.unsafeGetTensorImpl()), p.numel()));
        units->assign(u, values);
      }
      return;
    }
    const auto& data = ep.flat().data();
    for (const auto& s : layout.segments)
      data.narrow(0, s.local, s.length).copy_(weights(s.local, s.length));
  };
  return out;
}

}  // namespace strata
