// Engine::save_checkpoint / load_checkpoint: what the engine's state is, in which file.
//   model_states (rank 0): the module's parameters and buffers as trained (16-bit under mixed
//     precision), the step counters, loss scaler, LR schedule and the program's client state;
//   optim_states: the fp32 master weights and optimizer state of each rank's partition of the
//     flat layout, one file per rank at stages 1-2 (shared otherwise), with the partition's
//     place in the flat layout (shard_pieces.h), so that another world size or sharding can
//     re-partition them; the plain fp32 stage-0 path stores its per-parameter state instead.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "runtime/checkpoint/consolidate.h"
#include "runtime/checkpoint/layout.h"
#include "runtime/checkpoint/shard_pieces.h"
#include "runtime/engine.h"
#include "runtime/error.h"
#include "runtime/log.h"
#include "runtime/master_state.h"
#include "runtime/model_check.h"
#include "runtime/optim/state_io.h"

namespace strata {
namespace {

using checkpoint::NamedTensors;
using checkpoint::pieces_json;
using checkpoint::saved_pieces;
using checkpoint::saved_shard_map;

using Names = std::unordered_set<std::string>;

// The module's parameters and buffers but the MoE experts (`skip`), saved per expert apart.
NamedTensors model_tensors(torch::nn::Module& module, const Names& skip) {
  NamedTensors out;
  for (const auto& p : module.named_parameters())
    if (!skip.count(p.key())) out.emplace_back("param." + p.key(), p.value());
  for (const auto& b : module.named_buffers()) out.emplace_back("buffer." + b.key(), b.value());
  return out;
}

// One parameter's optimizer state into `out` and `scalars` under `prefix`.
void put_state(const optim::ParamState& state, const std::string& prefix, NamedTensors& out,
               json& scalars) {
  scalars[prefix + "type"] = state.type;
  for (const auto& item : state.scalars.items()) scalars[prefix + item.key()] = item.value();
  for (const auto& [name, t] : state.tensors) out.emplace_back(prefix + name, t.detach());
}

// LibTorch's optimizer archive travels as a uint8 tensor (JSON strings must be UTF-8).
torch::Tensor bytes_tensor(const std::string& bytes) {
  auto t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

std::string tensor_bytes(const torch::Tensor& t) {
  const auto c = t.contiguous().cpu();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()));
}

optim::ParamState get_state(const checkpoint::TensorFile& file, const std::string& prefix) {
  optim::ParamState state;
  state.type = file.scalars.at(prefix + "type").get<std::string>();
  const std::string step = prefix + "step";
  if (file.scalars.contains(step)) state.scalars["step"] = file.scalars.at(step);
  for (const auto& [name, t] : file.tensors)
    if (name.rfind(prefix, 0) == 0 && name.find('.', prefix.size()) == std::string::npos)
      state.tensors.emplace_back(name.substr(prefix.size()), t);
  return state;
}

// The trainable tensors in the engine's order, each under its first name (model_check.h): the
// names and sizes a resume checks, and the further names of tied weights (strata-ckpt gives them
// the same weights).
// The per-parameter layout (`flat` false) records the names only, as before.
// MoE experts (`skip`) are kept apart (runtime/engine_experts.cpp).
std::vector<NamedTensor> trainables(torch::nn::Module& module, const Names& skip) {
  std::vector<NamedTensor> out;
  for (auto& p : unique_parameters(module, true))
    if (!skip.count(p.name)) out.push_back(std::move(p));
  return out;
}

void put_trainables(torch::nn::Module& module, const Names& skip, json& scalars, bool flat) {
  json names = json::array(), numels = json::array(), aliases = json::object();
  for (const auto& p : trainables(module, skip)) {
    names.push_back(p.name);
    numels.push_back(p.tensor.numel());
    for (const auto& alias : p.aliases) aliases[alias] = p.name;
  }
  scalars[flat ? "flat_params" : "param_names"] = names;
  if (!flat) return;
  scalars["flat_param_numels"] = numels;
  scalars["flat_param_aliases"] = aliases;
}

// The checkpoint's trainable tensors must be this model's, in the same order and sizes:
// optimizer state is stored by position (flat ranges or indices).
void check_same_trainables(const json& scalars, const std::string& key, torch::nn::Module& module,
                           const Names& skip, const std::string& folder) {
  if (!scalars.contains(key)) return;  // saved before the names were kept
  const auto saved = scalars.at(key).get<std::vector<std::string>>();
  const auto mine = trainables(module, skip);
  std::vector<int64_t> numels;
  if (scalars.contains("flat_param_numels"))
    numels = scalars.at("flat_param_numels").get<std::vector<int64_t>>();
  const size_t n = std::max(saved.size(), mine.size());
  for (size_t i = 0; i < n; ++i) {
    const std::string s = i < saved.size() ? "'" + saved[i] + "'" : "nothing";
    const std::string m = i < mine.size() ? "'" + mine[i].name + "'" : "nothing";
    const bool size_differs = i < numels.size() && i < mine.size() &&
                              numels[i] != mine[i].tensor.numel();
    if (i >= saved.size() || i >= mine.size() || saved[i] != mine[i].name || size_differs)
      throw Error(fmt::format(
          "{}: the checkpoint's trainable parameters are not this model's: trainable #{} is {}{} "
          "in the checkpoint and {}{} here ({} saved, {} here). Resume with the same model and "
          "the same frozen parameters",
          folder, i, s, i < numels.size() ? fmt::format(" ({} elements)", numels[i]) : "", m,
          i < mine.size() ? fmt::format(" ({} elements)", mine[i].tensor.numel()) : "",
          saved.size(), mine.size()));
  }
}


// Where the checkpoint's flat layout comes from: stages 0-2 save the FlatParams layout; stage 3
// saves its shards as pieces of the same gap-free layout (trainable parameters in module order),
// so a checkpoint reads back at any stage and world size, and strata-ckpt consolidates it alike.
struct FlatLayout {
  int64_t numel = 0;
  zero::ShardMap shards;
  int64_t part = 0;
};

// MoE experts (`skip`) are not in it: they have their own layout (runtime/engine_experts.cpp).
FlatLayout flat_layout(torch::nn::Module& module, const zero::PartitionedOptimizer& partitioned,
                       const Names& skip) {
  const auto* units = partitioned.units();
  if (!units) return {partitioned.flat().numel(), partitioned.shards(), partitioned.partition_index()};
  std::unordered_map<const c10::TensorImpl*, int64_t> offset;
  int64_t numel = 0;
  for (const auto& p : unique_parameters(module, true)) {
    if (skip.count(p.name)) continue;
    offset[p.tensor.unsafeGetTensorImpl()] = numel;
    numel += p.tensor.numel();
  }
  std::vector<int64_t> offsets;
  for (const auto& p : units->trainable_params()) offsets.push_back(offset.at(p.unsafeGetTensorImpl()));
  return {numel, units->shards_over(offsets), partitioned.partition_index()};
}

}  // namespace

std::unordered_set<std::string> Engine::expert_names() const {
  std::unordered_set<std::string> names;
  for (const auto& e : experts_) names.insert(e.name);
  return names;
}

std::vector<std::pair<std::string, torch::Tensor>> Engine::stage3_host_copies(bool keep,
                                                                              bool with_experts) {
  std::unordered_map<const c10::TensorImpl*, torch::Tensor> copies;
  auto copy = [&](const zero::ParamUnits& units, zero::ParamCoordinator& coordinator) {
    for (size_t u = 0; u < units.size(); ++u) {
      coordinator.pin({u});
      if (keep)
        for (const auto& p : units.unit(u).params)
          copies[p.unsafeGetTensorImpl()] = p.detach().to(torch::kCPU, /*non_blocking=*/false,
                                                          /*copy=*/true);
      coordinator.unpin();
      coordinator.release_all();
    }
  };
  copy(*units_, *coordinator_);
  if (with_experts && expert_units_) copy(*expert_units_, *expert_coordinator_);
  NamedTensors out;
  if (!keep) return out;
  const auto skip = with_experts ? Names{} : expert_names();
  for (const auto& p : module_->named_parameters())
    if (!skip.count(p.key()))
      out.emplace_back("param." + p.key(), copies.at(p.value().unsafeGetTensorImpl()));
  for (const auto& b : module_->named_buffers()) out.emplace_back("buffer." + b.key(), b.value());
  return out;
}

template <class TensorFile>
void Engine::install_stage3_weights(const TensorFile& states) {
  for (size_t u = 0; u < units_->size(); ++u) {
    std::vector<torch::Tensor> values;
    for (const auto& name : units_->unit(u).names) values.push_back(states.at("param." + name));
    units_->assign(u, values);
  }
  for (const auto& b : module_->named_buffers()) b.value().copy_(states.at("buffer." + b.key()));
}

void Engine::save_16bit_model(const std::string& dir, const std::string& file) {
  torch::NoGradGuard no_grad;
  settle_step();
  if (coordinator_ && !config_.zero_optimization.stage3_gather_16bit_weights_on_model_save)
    throw Error(fmt::format(
        "{}: save_16bit_model at ZeRO stage 3 gathers every weight to rank 0; set "
        "zero_optimization.stage3_gather_16bit_weights_on_model_save to true, or save a "
        "checkpoint (save_checkpoint) and consolidate it with `strata-ckpt consolidate`",
        config_.source));
  if (expert_groups_.expert_parallel && expert_groups_.expert_parallel->size() > 1)
    throw Error(fmt::format(
        "{}: save_16bit_model writes rank 0's module, and with moe.ep_size {} rank 0 holds only "
        "some of the experts; save a checkpoint (save_checkpoint), which keeps every expert",
        config_.source, expert_groups_.expert_parallel->size()));
  NamedTensors params, buffers;
  const bool writer = data_parallel_rank() == 0;
  const auto whole =
      coordinator_ ? stage3_host_copies(writer, /*with_experts=*/true) : model_tensors(*module_, {});
  for (const auto& [key, t] : whole) {
    const bool param = key.rfind("param.", 0) == 0;
    (param ? params : buffers).emplace_back(key.substr(key.find('.') + 1), t.detach().cpu());
  }
  if (writer) {
    std::filesystem::create_directories(dir);
    checkpoint::save_module_archive(dir + "/" + file, params, buffers);
  }
  if (group_) group_->barrier();  // the file exists before any rank goes on
  log::info("[strata] saved the 16-bit model to {}/{}", dir, file);
}

void Engine::save_checkpoint(const std::string& dir, std::string tag, const json& client_state) {
  torch::NoGradGuard no_grad;
  settle_step();
  if (tag.empty()) tag = fmt::format("global_step{}", global_steps_);
  const int rank = data_parallel_rank(), world = data_parallel_size();
  checkpoint::CheckpointWriter writer(dir, tag, rank, world);

  json engine_state = {{"global_steps", global_steps_},
                       {"micro_steps", micro_steps_},
                       {"skipped_steps", skipped_steps_},
                       {"loss_scaler", scaler_.state()},
                       {"client_state", client_state}};
  if (lr_scheduler_) engine_state["lr_scheduler"] = lr_scheduler_->state_dict();
  if (coordinator_) {
    // Stage 3: the units gathered one at a time; rank 0 keeps a host copy of each.
    const auto whole = stage3_host_copies(/*keep=*/rank == 0, /*with_experts=*/false);
    if (rank == 0) writer.write_shared("model_states", whole, engine_state);
  } else if (rank == 0) {
    writer.write_shared("model_states", model_tensors(*module_, expert_names()), engine_state);
  }

  NamedTensors optim;
  json scalars = json::object();
  if (partitioned_) {
    const auto layout = flat_layout(*module_, *partitioned_, expert_names());
    scalars["layout"] = "flat";
    scalars["flat_numel"] = layout.numel;
    // Which parameter each range of the flat layout is (strata-ckpt consolidates by it).
    put_trainables(*module_, expert_names(), scalars, /*flat=*/true);
    // Where this partition's elements sit in the flat layout (zero/shard_map.h).
    scalars["shard_pieces"] = pieces_json(layout.shards.pieces(layout.part));
    auto [master, state] = export_master_state(*partitioned_, *optimizer_);
    optim.emplace_back("master", master);
    if (state) {
      put_state(*state, "state.", optim, scalars);
    } else {
      scalars["archive"] = true;
      optim.emplace_back("archive", bytes_tensor(optim::save_optimizer_archive(*optimizer_)));
    }
  } else {
    scalars["layout"] = "per_param";
    put_trainables(*module_, expert_names(), scalars, /*flat=*/false);
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto state = optim::export_param_state(*optimizer_, params_[i]);
      if (!state) {
        optim = {{"archive", bytes_tensor(optim::save_optimizer_archive(*optimizer_))}};
        scalars = {{"layout", "archive"}, {"archive", true}};
        break;
      }
      put_state(*state, fmt::format("state.{}.", i), optim, scalars);
    }
  }
  const bool partitioned_files = partitioned_ && partitioned_->shards().parts() > 1;
  if (partitioned_files)
    writer.write_partition("optim_states", optim, scalars);
  else if (rank == 0)
    writer.write_shared("optim_states", optim, scalars);
  save_expert_states(writer);

  if (group_) group_->barrier();  // every rank's files are written
  if (rank == 0) {
    checkpoint::RunInfo info;
    info.zero_stage = static_cast<int>(config_.zero_optimization.stage);
    info.compute_dtype = checkpoint::dtype_name(params_.front().scalar_type());
    info.extra = {{"global_steps", global_steps_}};
    writer.commit(info);
  }
  if (group_) group_->barrier();  // `latest` names the new checkpoint before anyone goes on
  log::info("[strata] saved checkpoint {}/{}", dir, tag);
}

json Engine::load_checkpoint(const std::string& dir, const std::string& tag) {
  torch::NoGradGuard no_grad;
  settle_step();
  // Everything is read and checked first; the engine changes only once all of it has passed, so
  // a checkpoint that does not fit leaves the model, master weights and optimizer as they were.
  checkpoint::CheckpointReader reader(dir, tag, {/*verify_checksums=*/false});
  const auto model = model_tensors(*module_, expert_names());
  const auto states = reader.load_shared("model_states", checkpoint::specs_of(model));
  const json& engine_state = states.scalars;
  const auto global_steps = engine_state.at("global_steps").get<int64_t>();
  const auto micro_steps = engine_state.at("micro_steps").get<int64_t>();
  const auto skipped_steps = engine_state.at("skipped_steps").get<int64_t>();
  LossScaler scaler = scaler_;
  scaler.load_state(engine_state.at("loss_scaler"));
  const json client_state = engine_state.at("client_state");
  const bool has_schedule = lr_scheduler_ && engine_state.contains("lr_scheduler");
  if (has_schedule) engine_state.at("lr_scheduler").at("last_batch_iteration").get<int64_t>();

  const bool partitioned_files = reader.has_partition("optim_states");
  const int saved_parts = partitioned_files ? reader.world_size() : 1;
  auto optim_file = [&](int part) {
    return partitioned_files ? reader.load_partition("optim_states", part)
                             : reader.load_shared("optim_states");
  };
  // What the optimizer gets: the master partition with its state, an archive, or per-parameter
  // states.
  torch::Tensor master;
  std::optional<optim::ParamState> master_state;
  std::optional<std::string> archive;
  std::vector<optim::ParamState> param_states;
  if (partitioned_) {
    const auto layout = flat_layout(*module_, *partitioned_, expert_names());
    const auto& shards = layout.shards;
    const int64_t part = layout.part;
    const auto first = optim_file(shards.parts() == saved_parts ? static_cast<int>(part) : 0);
    if (first.scalars.at("layout") != "flat")
      throw Error(fmt::format("{}: saved by the plain fp32 stage-0 path; resume it with the same "
                              "precision and ZeRO stage", reader.folder()));
    check_same_trainables(first.scalars, "flat_params", *module_, expert_names(), reader.folder());
    if (first.scalars.at("flat_numel").get<int64_t>() != layout.numel)
      throw Error(fmt::format("{}: {} trainable elements saved, this model has {}",
                              reader.folder(), first.scalars.at("flat_numel").get<int64_t>(),
                              layout.numel));
    const bool same_layout = shards.parts() == saved_parts &&
                             first.at("master").numel() == shards.partition_numel() &&
                             saved_pieces(first, static_cast<int>(part)) == shards.pieces(part);
    if (same_layout) {
      master = first.at("master");
      if (first.scalars.contains("archive"))
        archive = tensor_bytes(first.at("archive"));
      else
        master_state = get_state(first, "state.");
    } else {
      // Another world size or sharding: put the saved partitions back into the flat layout and
      // cut this rank's partition out of it.
      if (first.scalars.contains("archive"))
        throw Error(fmt::format("{}: this optimizer's state cannot be re-partitioned from {} "
                                "rank(s) to {} or another sharding (only Strata's Adam and SGD "
                                "state can)",
                                reader.folder(), saved_parts, shards.parts()));
      std::vector<checkpoint::TensorFile> files;
      for (int p = 0; p < saved_parts; ++p) files.push_back(optim_file(p));
      const auto saved = saved_shard_map(files);
      auto mine = [&](const std::string& name) {
        std::vector<torch::Tensor> parts;
        for (const auto& f : files) parts.push_back(f.at(name));
        return shards.gather(saved.assemble(parts, layout.numel), part);
      };
      master = mine("master");
      master_state = get_state(files.front(), "state.");
      for (auto& [name, t] : master_state->tensors) t = mine("state." + name);
    }
    if (master.sizes() != partitioned_->master().sizes())
      throw Error(fmt::format("{}: the saved master partition has shape {}, this rank's {}",
                              reader.folder(), c10::str(master.sizes()),
                              c10::str(partitioned_->master().sizes())));
    if (master_state) optim::check_param_state(*optimizer_, partitioned_->master(), *master_state);
  } else {
    const auto file = optim_file(0);
    const auto layout = file.scalars.at("layout").get<std::string>();
    if (layout == "flat")
      throw Error(fmt::format("{}: saved with mixed precision or ZeRO; resume it with the same "
                              "precision and a ZeRO stage of 1 or 2 (or the same stage 0 "
                              "precision)", reader.folder()));
    if (layout == "archive") {
      archive = tensor_bytes(file.at("archive"));
    } else {
      check_same_trainables(file.scalars, "param_names", *module_, expert_names(), reader.folder());
      for (size_t i = 0; i < params_.size(); ++i) {
        const auto prefix = fmt::format("state.{}.", i);
        if (!file.scalars.contains(prefix + "type"))
          throw Error(fmt::format("{}: no optimizer state for trainable parameter #{}: the "
                                  "checkpoint has fewer trainable parameters than this model",
                                  reader.folder(), i));
        param_states.push_back(get_state(file, prefix));
        optim::check_param_state(*optimizer_, params_[i], param_states.back());
      }
      if (file.scalars.contains(fmt::format("state.{}.type", params_.size())))
        throw Error(fmt::format("{}: the checkpoint has more trainable parameters than this "
                                "model's {}", reader.folder(), params_.size()));
    }
  }

  const auto install_experts = read_expert_states(reader, micro_steps);

  // Everything fits: install it. LibTorch's own archive goes first, the one step that can still
  // fail (it is checked only by loading it).
  if (archive) optim::load_optimizer_archive(*optimizer_, *archive);
  if (units_)
    install_stage3_weights(states);
  else
    states.copy_to(model);
  if (partitioned_) install_master_state(*partitioned_, *optimizer_, master, master_state);
  for (size_t i = 0; i < param_states.size(); ++i)
    optim::import_param_state(*optimizer_, params_[i], param_states[i]);
  install_experts();
  global_steps_ = global_steps;
  micro_steps_ = micro_steps;
  skipped_steps_ = skipped_steps;
  scaler_ = scaler;
  if (has_schedule) lr_scheduler_->load_state_dict(engine_state.at("lr_scheduler"));
  follow_lr_schedule();  // the experts' optimizer steps at the schedule's lr too, not its own
  log::info("[strata] loaded checkpoint {} (step {}, saved by {} rank(s))", reader.folder(),
            global_steps_, reader.world_size());
  return client_state;
}

}  // namespace strata
