// Engine::save_checkpoint / load_checkpoint: what the engine's state is, in which file.
//   model_states (rank 0): the module's parameters and buffers as trained (16-bit under mixed
//     precision), the step counters, loss scaler, LR schedule and the program's client state;
//   optim_states: the fp32 master weights and optimizer state of each rank's partition of the
//     flat layout, one file per rank at stages 1-2 (shared otherwise), with the partition's
//     place in the flat layout (shard_pieces.h), so that another world size or sharding can
//     re-partition them; the plain fp32 stage-0 path stores its per-parameter state instead.
// At stage 3 and with NVMe offload nothing here is whole in host memory: the model is written and
// installed one unit at a time, the master and moments stream between swap files and checkpoint
// in tiles, and a partition of another world size is read from the saved pieces it overlaps
// (checkpoint/saved_partitions.h). Every file a rank reads is checksummed before anything is
// installed.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "runtime/checkpoint/consolidate.h"
#include "runtime/checkpoint/layout.h"
#include "runtime/checkpoint/rng_state.h"
#include "runtime/checkpoint/saved_partitions.h"
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

using Names = std::unordered_set<std::string>;

// The module's parameters and buffers but the MoE experts (`skip`), saved per expert apart.
NamedTensors model_tensors(torch::nn::Module& module, const Names& skip) {
  NamedTensors out;
  for (const auto& p : module.named_parameters())
    if (!skip.count(p.key())) out.emplace_back("param." + p.key(), p.value());
  for (const auto& b : module.named_buffers()) out.emplace_back("buffer." + b.key(), b.value());
  return out;
}

// Every submodule's path, in module order (the module archive needs its parameter-free ones).
std::vector<std::string> submodule_paths(torch::nn::Module& module) {
  std::vector<std::string> out;
  for (const auto& m : module.named_modules("", /*include_self=*/false)) out.push_back(m.key());
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


// Strata cast every buffer to the 16-bit dtype (LibTorch's Module::to) until issue 28, so bf16/fp16
// checkpoints hold bool and integer buffers (BatchNorm's num_batches_tracked) as 16-bit floats.
// Such a buffer is accepted as saved (its `expected` spec is changed) and returned by name, to be
// converted back to the model's dtype once loaded.
std::vector<std::pair<std::string, torch::ScalarType>> accept_cast_buffers(
    const checkpoint::CheckpointReader& reader, std::vector<checkpoint::TensorSpec>& expected) {
  const auto* entry = reader.manifest().find("model_states", -1);
  if (!entry) return {};  // load_shared names what is missing
  std::unordered_map<std::string, torch::ScalarType> saved;
  for (const auto& s : checkpoint::read_tensor_file_info(reader.path_of(*entry)).tensors)
    saved.emplace(s.name, s.dtype);
  std::vector<std::pair<std::string, torch::ScalarType>> cast;
  for (auto& spec : expected) {
    const auto it = saved.find(spec.name);
    if (spec.name.rfind("buffer.", 0) != 0 || it == saved.end() || c10::isFloatingType(spec.dtype) ||
        (it->second != torch::kBFloat16 && it->second != torch::kHalf))
      continue;
    cast.emplace_back(spec.name, spec.dtype);
    log::info("[strata] checkpoint {}: {} was saved as {} (written before Strata kept integer and "
              "bool buffers in their own dtype); restored as {}",
              reader.folder(), spec.name, c10::toString(it->second), c10::toString(spec.dtype));
    spec.dtype = it->second;
  }
  return cast;
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

// The saved model as install_stage3_weights reads it: each tensor from the file when it is
// asked for (a unit's parameters at a time), integer buffers saved as 16-bit converted back.
struct StreamedModel {
  const checkpoint::TensorFileReader& file;
  const std::vector<std::pair<std::string, torch::ScalarType>>& cast;

  torch::Tensor at(const std::string& name) const {
    auto t = file.at(name);
    for (const auto& [buffer, dtype] : cast)
      if (name == buffer) t = t.to(dtype);
    return t;
  }
};

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
  for (const auto& p : module_->named_parameters()) {
    if (skip.count(p.key())) continue;
    // Not in a unit (a parameter that is not floating point): whole on every rank.
    const auto it = copies.find(p.value().unsafeGetTensorImpl());
    out.emplace_back("param." + p.key(), it != copies.end() ? it->second : p.value().detach().cpu());
  }
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
  for (const auto& p : module_->named_parameters())
    if (units_->unit_of(p.value().storage().unsafeGetStorageImpl()) < 0 && !is_expert(p.value()))
      p.value().copy_(states.at("param." + p.key()));  // kept whole (not floating point)
  for (const auto& b : module_->named_buffers()) b.value().copy_(states.at("buffer." + b.key()));
}

void Engine::stream_stage3_model(checkpoint::TensorFileWriter* out) {
  // Every name of each parameter (tied weights have several), experts left out.
  const auto skip = expert_names();
  std::unordered_map<const c10::TensorImpl*, std::vector<std::string>> names_of;
  for (const auto& p : module_->named_parameters())
    if (!skip.count(p.key())) names_of[p.value().unsafeGetTensorImpl()].push_back(p.key());
  std::unordered_set<const c10::TensorImpl*> in_units;
  for (size_t u = 0; u < units_->size(); ++u) {
    coordinator_->pin({u});
    for (const auto& p : units_->unit(u).params) {
      in_units.insert(p.unsafeGetTensorImpl());
      if (!out) continue;
      const auto it = names_of.find(p.unsafeGetTensorImpl());
      if (it != names_of.end())
        for (const auto& name : it->second) out->add("param." + name, p);
    }
    coordinator_->unpin();
    coordinator_->release_all();
  }
  if (!out) return;
  for (const auto& p : module_->named_parameters())  // not in a unit (not floating point): whole
    if (!skip.count(p.key()) && !in_units.count(p.value().unsafeGetTensorImpl()))
      out->add("param." + p.key(), p.value());
  for (const auto& b : module_->named_buffers()) out->add("buffer." + b.key(), b.value());
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
    checkpoint::save_module_archive(dir + "/" + file, params, buffers, submodule_paths(*module_));
  }
  if (group_) group_->barrier();  // the file exists before any rank goes on
  log::info("[strata] saved the 16-bit model to {}/{}", dir, file);
}

void Engine::save_checkpoint(const std::string& dir, std::string tag, const json& client_state) {
  torch::NoGradGuard no_grad;
  settle_step();
  if (tag.empty()) tag = fmt::format("global_step{}", global_steps_);
  // Inside an accumulation window the partial gradient lives only in this process: a resume
  // would step on part of a window (at another world size, on a window of another length).
  if (micro_steps_ % gradient_accumulation_steps() != 0)
    throw Error(fmt::format(
        "save_checkpoint({}, {}): called inside a gradient accumulation window (micro-step {} "
        "of {}: the window's partial gradients are not saved, so a resume would step on part "
        "of a window); save after the engine->step() that ends a window "
        "(is_gradient_accumulation_boundary() true before it)",
        dir, tag, micro_steps_ % gradient_accumulation_steps(), gradient_accumulation_steps()));
  const int rank = data_parallel_rank(), world = data_parallel_size();
  checkpoint::CheckpointWriter writer(dir, tag, rank, world);

  // The position is global steps and samples (DeepSpeed's); micro-steps follow from them and
  // this run's accumulation, which another world size changes.
  json engine_state = {{"global_steps", global_steps_},
                       {"micro_steps", micro_steps_},
                       {"gradient_accumulation_steps", gradient_accumulation_steps()},
                       {"global_samples", global_samples()},
                       {"skipped_steps", skipped_steps_},
                       {"loss_scaler", scaler_.state()},
                       {"client_state", client_state},
                       {checkpoint::kSubmodulesKey, submodule_paths(*module_)}};
  if (lr_scheduler_) engine_state["lr_scheduler"] = lr_scheduler_->state_dict();
  if (coordinator_) {
    // Stage 3: the units gathered one at a time, each written into rank 0's file as it comes;
    // the footer lists the tensors in the module's order, as the other stages write them.
    std::vector<std::string> order;
    for (const auto& [name, t] : model_tensors(*module_, expert_names())) order.push_back(name);
    if (rank == 0)
      writer.stream_shared(
          "model_states",
          [&](checkpoint::TensorFileWriter& out) { stream_stage3_model(&out); }, engine_state,
          order);
    else
      stream_stage3_model(nullptr);
  } else if (rank == 0) {
    writer.write_shared("model_states", model_tensors(*module_, expert_names()), engine_state);
  }

  NamedTensors optim;
  json scalars = json::object();
  const bool partitioned_files = partitioned_ && partitioned_->shards().parts() > 1;
  if (partitioned_) {
    const auto layout = flat_layout(*module_, *partitioned_, expert_names());
    scalars["layout"] = "flat";
    scalars["flat_numel"] = layout.numel;
    // Which parameter each range of the flat layout is (strata-ckpt consolidates by it).
    put_trainables(*module_, expert_names(), scalars, /*flat=*/true);
    // Where this partition's elements sit in the flat layout (zero/shard_map.h).
    scalars["shard_pieces"] = pieces_json(layout.shards.pieces(layout.part));
    // The master and its state, streamed from wherever they live (NVMe: tile by tile). The
    // state's scalars join `scalars` while the file is written, before its footer.
    auto write = [&](checkpoint::TensorFileWriter& out) {
      if (write_master_state(*partitioned_, *optimizer_, out, scalars)) return;
      scalars["archive"] = true;
      out.add("archive", bytes_tensor(optim::save_optimizer_archive(*optimizer_)));
    };
    if (partitioned_files)
      writer.stream_partition("optim_states", write, scalars);
    else if (rank == 0)
      writer.stream_shared("optim_states", write, scalars);
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
  if (!partitioned_ && rank == 0) writer.write_shared("optim_states", optim, scalars);
  save_expert_states(writer);
  // Each rank's random generators (dropout's draws), so that a resume is exact for them too.
  writer.write_partition(checkpoint::kRngStatesKind, checkpoint::capture_rng_states());

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
  auto specs = checkpoint::specs_of(model);
  const auto cast_buffers = accept_cast_buffers(reader, specs);
  // Stage 3 reads the model a unit at a time from the verified file; the other stages, whose
  // model is whole in memory anyway, load it whole.
  std::optional<checkpoint::TensorFile> states;
  std::unique_ptr<checkpoint::TensorFileReader> streamed;
  if (units_) {
    streamed = reader.open_shared("model_states", &specs);
  } else {
    states = reader.load_shared("model_states", specs);
    for (auto& [name, t] : states->tensors)
      for (const auto& [cast, dtype] : cast_buffers)
        if (name == cast) t = t.to(dtype);
  }
  const json& engine_state = streamed ? streamed->scalars() : states->scalars;
  const auto global_steps = engine_state.at("global_steps").get<int64_t>();
  const auto saved_micro_steps = engine_state.at("micro_steps").get<int64_t>();
  // Checkpoints before the accumulation was recorded: a boundary is micro = global x gas.
  const int64_t saved_gas =
      engine_state.contains("gradient_accumulation_steps")
          ? engine_state.at("gradient_accumulation_steps").get<int64_t>()
          : (global_steps > 0 && saved_micro_steps % global_steps == 0
                 ? saved_micro_steps / global_steps
                 : (global_steps == 0 && saved_micro_steps == 0 ? 1 : 0));
  if (saved_gas <= 0 || saved_micro_steps != global_steps * saved_gas)
    throw Error(fmt::format(
        "{}: saved inside a gradient accumulation window (micro-step {} after {} optimizer "
        "steps): its partial gradients are not in the checkpoint, so no resume continues that "
        "window exactly; resume from a checkpoint saved after an optimizer step",
        reader.folder(), saved_micro_steps, global_steps));
  // This run's accumulation, whatever the saved run's was (another world size changes it).
  const int64_t micro_steps = global_steps * gradient_accumulation_steps();
  const auto skipped_steps = engine_state.at("skipped_steps").get<int64_t>();
  LossScaler scaler = scaler_;
  scaler.load_state(engine_state.at("loss_scaler"));
  const json client_state = engine_state.at("client_state");
  const bool has_schedule = lr_scheduler_ && engine_state.contains("lr_scheduler");
  if (has_schedule) engine_state.at("lr_scheduler").at("last_batch_iteration").get<int64_t>();

  const bool partitioned_files = reader.has_partition("optim_states");
  const int saved_parts = partitioned_files ? reader.world_size() : 1;
  // What the optimizer gets: the master partition with its state read from the saved partitions
  // by range, an archive, or per-parameter states.
  std::unique_ptr<checkpoint::SavedPartitions> saved;
  std::optional<optim::ParamState> master_state;
  std::optional<std::string> archive;
  std::vector<optim::ParamState> param_states;
  zero::ShardMap shards;
  int64_t part = 0;
  if (partitioned_) {
    const auto layout = flat_layout(*module_, *partitioned_, expert_names());
    shards = layout.shards;
    part = layout.part;
    // Footers only, but for rank 0's file, whose scalars are checked here: the checksums of
    // the other files this rank reads are checked below, before anything is installed (with
    // another world size each rank reads a few of them, not all).
    std::vector<std::unique_ptr<checkpoint::TensorFileReader>> files;
    for (int p = 0; p < saved_parts; ++p)
      files.push_back(partitioned_files ? reader.open_partition("optim_states", p, p == 0)
                                        : reader.open_shared("optim_states", nullptr, true));
    const json& first = files.front()->scalars();
    if (first.at("layout") != "flat")
      throw Error(fmt::format("{}: saved by the plain fp32 stage-0 path; resume it with the same "
                              "precision and ZeRO stage", reader.folder()));
    check_same_trainables(first, "flat_params", *module_, expert_names(), reader.folder());
    if (first.at("flat_numel").get<int64_t>() != layout.numel)
      throw Error(fmt::format("{}: {} trainable elements saved, this model has {}",
                              reader.folder(), first.at("flat_numel").get<int64_t>(),
                              layout.numel));
    saved = std::make_unique<checkpoint::SavedPartitions>(std::move(files));
    saved->verify_for(shards, part);
    if (saved->scalars().contains("archive")) {
      // LibTorch's archive holds one partition as it was cut: only the same cut can use it.
      if (!saved->same_as_saved(shards, part))
        throw Error(fmt::format("{}: this optimizer's state cannot be re-partitioned from {} "
                                "rank(s) to {} or another sharding (only Strata's Adam and SGD "
                                "state can)",
                                reader.folder(), saved_parts, shards.parts()));
      saved->file(static_cast<int>(part)).verify();
      archive = tensor_bytes(saved->file(static_cast<int>(part)).at("archive"));
    } else {
      std::vector<std::string> names;
      for (const auto& spec : saved->file(0).info().tensors) names.push_back(spec.name);
      master_state = saved_state_header(saved->scalars(), names, partitioned_->master());
      optim::check_param_state(*optimizer_, partitioned_->master(), *master_state);
    }
  } else {
    const auto file = partitioned_files ? reader.load_partition("optim_states", 0)
                                        : reader.load_shared("optim_states");
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

  // Without saved call counters (older checkpoints), the layers' noise continues from the saved
  // run's forwards: one per micro-step.
  const auto install_experts = read_expert_states(reader, saved_micro_steps);
  // This rank's generator states: absent from checkpoints saved before they were kept, and for
  // a rank the saving world did not have.
  std::optional<checkpoint::TensorFile> rng;
  const bool has_rng = reader.has_partition(checkpoint::kRngStatesKind);
  if (has_rng && data_parallel_rank() < reader.world_size())
    rng = reader.load_partition(checkpoint::kRngStatesKind, data_parallel_rank());

  // Everything fits: install it. LibTorch's own archive goes first, one of the two steps that can
  // still fail (it is checked only by loading it).
  if (archive) optim::load_optimizer_archive(*optimizer_, *archive);
  // Then the generators, which LibTorch checks as it sets them (a state of another version).
  if (rng) {
    const auto missing = checkpoint::restore_rng_states(*rng);
    if (!missing.empty())
      log::info("[strata] checkpoint {}: random generators restored but for {}", reader.folder(),
                missing);
  } else {
    log::info("[strata] checkpoint {}: the random generators were not restored ({}); dropout and "
              "other random draws continue from this process's state",
              reader.folder(),
              has_rng ? fmt::format("saved by {} rank(s), this is rank {}", reader.world_size(),
                                    data_parallel_rank())
                      : std::string("saved before checkpoints kept them"));
  }
  if (units_)
    install_stage3_weights(StreamedModel{*streamed, cast_buffers});
  else
    states->copy_to(model);
  if (partitioned_) {
    auto source = [&](const std::string& name, int64_t offset, int64_t n, float* dst) {
      saved->read(name, shards, part, offset, n, dst);
    };
    if (master_state) {
      install_master_state(*partitioned_, *optimizer_, source, *master_state);
    } else {  // the archive holds the state; the master is ours to read
      auto master = torch::empty({partitioned_->master().numel()}, torch::kFloat);
      source("master", 0, master.numel(), master.data_ptr<float>());
      partitioned_->master().copy_(master.view(partitioned_->master().sizes()));
    }
  }
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
