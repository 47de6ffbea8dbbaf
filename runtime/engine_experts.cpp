// The engine's MoE side (DeepSpeed-MoE's engine and ZeRO handling of expert parameters):
//   - the expert parameters of the model's strata::moe::MoE layers differ across the ranks of an
//     expert-parallel group; they are checked and broadcast within their expert-data-parallel
//     group, and trained by a second partitioned optimizer over that group (engine.cpp);
//   - checkpoints hold them per expert: every rank's partition of the expert master weights,
//     optimizer state and 16-bit weights is saved with its place in a global layout that does
//     not depend on ep_size (layer, then global expert, then the expert's parameters), so a
//     checkpoint saved at one ep_size (or world size, or ZeRO stage) loads at another.
#include <algorithm>
#include <cmath>
#include <map>
#include <unordered_map>

#include <fmt/format.h>

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

// The name of an expert parameter relative to one expert: "w1" for the built-in stacked tensors,
// "fc.weight" for a user expert registered as "experts.5.fc.weight".
std::string per_expert_name(const moe::ExpertParameter& e) {
  std::string rest = e.name.substr(e.layer_prefix.size() + std::string("experts.").size());
  if (!e.stacked) rest = rest.substr(rest.find('.') + 1);
  return rest;
}

ExpertLayout expert_layout(const std::vector<moe::ExpertParameter>& experts,
                           const zero::FlatParams& flat) {
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
    const std::string name = per_expert_name(e);
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
  for (size_t i = 0; i < flat.params().size(); ++i) {
    const auto& e = *by_impl.at(flat.params()[i].unsafeGetTensorImpl());
    const auto& l = layers[e.layer_prefix];
    const int64_t per = e.param.numel() / e.num_experts;
    for (int64_t j = 0; j < e.num_experts; ++j)
      out.segments.push_back({flat.offset(i) + j * per, per,
                              l.base + (e.first_expert + j) * l.expert_numel +
                                  l.offset.at(per_expert_name(e))});
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

// This rank's local flat layout (flat_numel elements) cut out of a global expert tensor.
torch::Tensor to_local(const torch::Tensor& global, const ExpertLayout& layout, int64_t flat_numel) {
  auto local = torch::zeros({flat_numel}, global.options());
  for (const auto& s : layout.segments)
    local.narrow(0, s.local, s.length).copy_(global.narrow(0, s.global, s.length));
  return local;
}

}  // namespace

bool Engine::is_expert(const torch::Tensor& p) const {
  for (const auto& e : experts_)
    if (e.param.unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) return true;
  return false;
}

void Engine::find_experts() {
  experts_ = moe::expert_parameters(*module_);
  if (experts_.empty()) {
    if (config_.moe.num_experts > 1)
      log::info("[strata] note: the config's moe block describes {} experts, but the model has no "
                "strata::moe::MoE layer; the block is read by programs that build their layers "
                "from it (moe::MoEOptions::from_config)",
                config_.moe.num_experts);
    return;
  }
  const auto& first = experts_.front();
  if (config_.zero_optimization.stage == 3)
    throw Error(fmt::format(
        "{}: the model has MoE layers (expert parameter '{}') and zero_optimization.stage is 3: "
        "MoE with ZeRO stage 3 is not run by this build yet; use stage 0, 1 or 2",
        config_.source, first.name));
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
  if (config_.moe.num_experts > 1 && config_.moe.ep_size != ep)
    throw Error(fmt::format("{}: moe.ep_size is {} but the model's MoE layers were built with "
                            "ep_size {}; build them from the same config "
                            "(moe::MoEOptions::from_config)",
                            config_.source, config_.moe.ep_size, ep));
  // An ep_size that does not divide the world is refused here, by comm's expert layout.
  expert_groups_ = comm::expert_groups(group_, static_cast<int>(ep));
  for (auto* layer : moe::moe_layers(*module_)) {
    const auto& g = layer->options().ep_group;
    if ((g ? g->size() : 1) != ep)
      throw Error(fmt::format("strata::initialize: an MoE layer's expert-parallel group has {} "
                              "ranks for ep_size {}",
                              g ? g->size() : 1, ep));
  }
  const auto& edp = expert_groups_.expert_data_parallel;
  log::info("[strata] MoE: {} expert parameter tensor(s) in {} layer(s), ep_size {}: expert "
            "gradients reduced over expert-data-parallel groups of {} rank(s)",
            experts_.size(), moe::moe_layers(*module_).size(), ep, edp ? edp->size() : 1);
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
  if (!expert_optimizer_) return;
  const double lr = optimizer_->param_groups().at(0).options().get_lr() * expert_lr_ratio_;
  for (auto& group : expert_optimizer_->param_groups()) group.options().set_lr(lr);
}

void Engine::save_expert_states(checkpoint::CheckpointWriter& writer) {
  if (!expert_partitioned_) return;
  const auto& ep = *expert_partitioned_;
  const auto layout = expert_layout(experts_, ep.flat());
  const auto& shards = ep.shards();
  const int64_t part = ep.partition_index();
  // Unpartitioned (stage 0), every rank of an expert-data-parallel group holds the same experts:
  // its first rank writes them.
  const auto& edp = expert_groups_.expert_data_parallel;
  const bool writes = shards.parts() > 1 || !edp || edp->rank() == 0;
  json scalars = {{"expert_layout", layout.describe}, {"expert_numel", layout.numel}};
  checkpoint::NamedTensors tensors;
  std::vector<zero::ShardPiece> pieces;
  if (writes) {
    pieces = to_global(shards.pieces(part), layout);
    auto [master, state] = export_master_state(ep, *expert_optimizer_);
    tensors.emplace_back("master", master);
    tensors.emplace_back("weights", shards.gather(ep.flat().data(), part));
    if (!state)
      throw Error("save_checkpoint: the experts' optimizer state cannot be saved per expert (only "
                  "Strata's Adam and SGD state can); use one of them for MoE models");
    scalars["state.type"] = state->type;
    for (const auto& item : state->scalars.items()) scalars["state." + item.key()] = item.value();
    for (const auto& [name, t] : state->tensors) tensors.emplace_back("state." + name, t.detach());
  }
  scalars["expert_pieces"] = checkpoint::pieces_json(pieces);
  writer.write_partition("expert_states", tensors, scalars);
}

std::function<void()> Engine::read_expert_states(const checkpoint::CheckpointReader& reader) {
  const bool has_experts = reader.has_partition("expert_states");
  if (!expert_partitioned_) {
    if (has_experts)
      throw Error(fmt::format("{}: the checkpoint holds MoE experts and this model has no MoE "
                              "layer", reader.folder()));
    return [] {};
  }
  if (!has_experts)
    throw Error(fmt::format("{}: the checkpoint holds no MoE experts and this model has MoE layers",
                            reader.folder()));
  const auto& ep = *expert_partitioned_;
  const auto layout = expert_layout(experts_, ep.flat());
  // Every rank's file: the partitions that cover the global layout, each expert once.
  const checkpoint::SavedExperts saved(reader);
  if (saved.layout() != layout.describe)
    throw Error(fmt::format("{}: the checkpoint's MoE experts are not this model's: saved {}, this "
                            "model {}",
                            reader.folder(), saved.layout().dump(), layout.describe.dump()));
  const int64_t flat_numel = ep.flat().padded_numel();
  const int64_t part = ep.partition_index();
  auto mine = [&](const std::string& name) {
    return ep.shards().gather(to_local(saved.assemble(name), layout, flat_numel), part);
  };
  const auto master = mine("master");
  const auto weights = to_local(saved.assemble("weights"), layout, flat_numel);
  optim::ParamState state;
  state.type = saved.scalars().at("state.type").get<std::string>();
  if (saved.scalars().contains("state.step")) state.scalars["step"] = saved.scalars().at("state.step");
  for (const auto& name : saved.state_tensors())
    state.tensors.emplace_back(name.substr(6), mine(name));
  if (master.sizes() != ep.master().sizes())
    throw Error(fmt::format("{}: the experts' master partition has shape {}, this rank's {}",
                            reader.folder(), c10::str(master.sizes()), c10::str(ep.master().sizes())));
  optim::check_param_state(*expert_optimizer_, ep.master(), state);
  return [this, master, weights, state, layout] {
    auto& ep = *expert_partitioned_;
    install_master_state(ep, *expert_optimizer_, master, state);
    const auto& data = ep.flat().data();
    for (const auto& s : layout.segments)
      data.narrow(0, s.local, s.length).copy_(weights.narrow(0, s.local, s.length));
  };
}

}  // namespace strata
